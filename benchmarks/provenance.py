"""What every result file records about the run that wrote it (``provenance``), and the one way benchmark
scripts write a result (``write_result``): the commit and whether the tree was dirty (git, or
``FP4MOE_COMMIT`` where git is absent, as on the GPU machine), the command line, the device (name, compute
capability, driver, memory), the library versions, the UTC date and the number of repeats behind each figure.

Torch-free at import: ``benchmarks/report.py`` and the CPU scripts use it without a GPU stack."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARIES = ("torch", "triton", "fla-core", "transformers", "fp4moe")


def _git(*args: str) -> str | None:
    try:
        r = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def commit() -> dict:
    """{"commit", "dirty", "source"}: from git when the tree is a clone, else ``FP4MOE_COMMIT`` (the GPU
    machine's copy has no .git; scripts/gpu_test.sh and benchmarks/verify_gpu.sh pass it), else unknown.
    ``FP4MOE_COMMIT`` ending in ``-dirty`` marks a dirty tree."""
    head = _git("rev-parse", "--short=7", "HEAD")
    if head:
        status = _git("status", "--porcelain", "--untracked-files=no")
        return dict(commit=head, dirty=bool(status), source="git")
    env = os.environ.get("FP4MOE_COMMIT", "").strip()
    if env:
        return dict(commit=env.removesuffix("-dirty"), dirty=env.endswith("-dirty"), source="FP4MOE_COMMIT")
    return dict(commit=None, dirty=None, source="unknown")


def _version(name: str) -> str | None:
    module = {"fla-core": "fla"}.get(name, name)
    if module in sys.modules:  # the version actually imported (the GPU machine installs over the image's)
        v = getattr(sys.modules[module], "__version__", None)
        if v:
            return str(v)
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def device() -> dict:
    """The CUDA device when torch is imported and sees one; else the host's CPU."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        p = torch.cuda.get_device_properties(torch.cuda.current_device())
        driver = None
        try:
            r = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20,
            )  # fmt: skip
            driver = r.stdout.split("\n")[0].strip() or None
        except (OSError, subprocess.TimeoutExpired):
            pass
        return dict(
            name=p.name, compute_capability=f"{p.major}.{p.minor}", driver=driver, cuda=torch.version.cuda,
            memory_gib=round(p.total_memory / 2**30, 1),
        )  # fmt: skip
    return dict(name="cpu", processor=platform.processor() or platform.machine(), cores=os.cpu_count())


_AT_START = commit()  # the tree a run measured is the one it started on: a long run may outlast a commit


def provenance(repeats: int | None) -> dict:
    """The record stamped into a result: the commit as the run started, and the rest. ``repeats``: the timed
    runs each figure in it is the median of (None where the script has no such notion)."""
    return dict(
        **_AT_START,
        command=[Path(sys.argv[0]).name if sys.argv else "", *sys.argv[1:]],
        device=device(),
        versions={"python": platform.python_version()} | {n: _version(n) for n in LIBRARIES},
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        repeats=repeats,
    )


def write_result(path: str | Path, result: dict, repeats: int | None = None, indent: int | None = 2) -> Path:
    """Write ``result`` as JSON to ``path`` with its ``provenance`` record; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    stamped = dict(result) | {"provenance": provenance(repeats)}
    path.write_text(json.dumps(stamped, indent=indent, default=float) + "\n")
    return path
