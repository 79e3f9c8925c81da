"""The GPU parts' time budget (tests/deadline_plugin.py): past FP4MOE_TEST_DEADLINE pytest stops after the test in
hand, and its summary still names the failures so far."""

import os
import subprocess
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def _pytest(tmp_path: Path, deadline: float) -> subprocess.CompletedProcess:
    (tmp_path / "test_three.py").write_text(
        "def test_fails():\n    assert 1 == 2\n\n\ndef test_second():\n    pass\n\n\ndef test_third():\n    pass\n"
    )
    env = {**os.environ, "PYTHONPATH": str(TESTS), "FP4MOE_TEST_DEADLINE": str(deadline)}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", "-p", "deadline_plugin",
         "-p", "no:xdist", str(tmp_path / "test_three.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_past_the_deadline_the_session_stops_and_names_its_failures(tmp_path):
    out = _pytest(tmp_path, time.time() - 1)
    assert "FAILED test_three.py::test_fails" in out.stdout, out.stdout
    assert out.stdout.splitlines()[-1].startswith("1 failed in"), out.stdout  # the other two never ran
    assert "FP4MOE_TEST_DEADLINE passed after" in out.stdout, out.stdout


def test_before_the_deadline_every_test_runs(tmp_path):
    out = _pytest(tmp_path, time.time() + 600)
    assert "1 failed, 2 passed" in out.stdout, out.stdout
