"""FP4MOE_TEST_DEADLINE (seconds since the epoch): once it has passed, the session stops after the test in hand
and prints its summary as usual, failures named, where a signal from outside would cut the summary too.
scripts/gpu_test.sh sets it from FP4MOE_TEST_BUDGET_S, so that a GPU part cut for time still says what failed
and what it did not reach."""

import os
import time

import pytest

_session: pytest.Session | None = None


def pytest_sessionstart(session: pytest.Session) -> None:
    global _session
    _session = session


def pytest_runtest_logfinish(nodeid: str, location) -> None:
    deadline = float(os.environ.get("FP4MOE_TEST_DEADLINE") or "inf")
    if time.time() > deadline and _session is not None and not _session.shouldstop:
        _session.shouldstop = f"FP4MOE_TEST_DEADLINE passed after {nodeid}: the tests after it did not run"
