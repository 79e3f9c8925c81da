"""The package as users install it: the wheel built from this tree, installed into a fresh virtual environment
(the dependencies reused from this one, so the check is offline and fast), runs ``fp4moe demo`` -- data files,
templates and the entry point included, nothing read from the source tree."""

import os
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*argv, cwd=None, timeout=600) -> str:
    # no PYTHONPATH: with src on it, pip would take the build's src/fp4moe.egg-info for an installed fp4moe
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert out.returncode == 0, f"{argv}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def test_wheel_installs_and_runs_the_demo(tmp_path):
    dist = tmp_path / "dist"
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), str(ROOT))
    (wheel,) = dist.glob("fp4moe-*.whl")
    with zipfile.ZipFile(wheel) as z:  # the license pyproject declares, shipped
        (license_file,) = [n for n in z.namelist() if n.endswith(".dist-info/licenses/LICENSE")]
        assert z.read(license_file).decode().lstrip().startswith("Apache License\n")

    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", str(venv))
    python = venv / "bin" / "python"
    purelib = Path(_run(str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip())
    _run(sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q", str(wheel))
    # then this environment's packages, after the new one's own (a plain path: its .pth files, among them the
    # editable install of this tree, are not run, so fp4moe can only come from the wheel)
    ours = [sysconfig.get_paths()["purelib"], *site.getsitepackages()]
    (purelib / "zz-deps.pth").write_text("\n".join(dict.fromkeys(ours)) + "\n")

    where = _run(str(python), "-c", "import fp4moe; print(fp4moe.__file__)", cwd=tmp_path)
    assert where.startswith(str(venv)), where
    out = _run(str(venv / "bin" / "fp4moe"), "demo", "--out", str(tmp_path / "demo"), cwd=tmp_path)
    assert "result                               OK" in out and "24 tokens:" in out
    assert (tmp_path / "demo" / "tiny-nvfp4-modelopt" / "README.md").exists()  # the model card
