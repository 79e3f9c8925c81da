"""Programmatic dependent launch settings (``kernels.pdl_args``): which kernels wait, and which let the next
one start early. The kernels' own behaviour under these settings is exercised on the GPU
(tests/engine/test_cuda_runner.py, the decode benchmark's correctness gate); the interpreter runs with PDL
off."""

from __future__ import annotations

import pytest

from fp4moe import kernels


@pytest.mark.parametrize(
    ("level", "trigger", "pdl"),
    [
        (2, "", 1),  # plain wait
        (2, "start", 2),  # release the next kernel, then wait
        (2, "after_wait", 3),  # wait, then release the next kernel
        (1, "start", 1),  # FP4MOE_PDL=1: waits only
        (1, "after_wait", 1),
    ],
)
def test_pdl_levels_and_triggers(level, trigger, pdl, monkeypatch):
    monkeypatch.setattr(kernels, "_PDL", level)
    assert kernels.pdl_args(trigger) == {"PDL": pdl, "launch_pdl": True}


def test_no_pdl_launches_without_the_attribute(monkeypatch):
    monkeypatch.setattr(kernels, "_PDL", 0)
    assert kernels.pdl_args("start") == {"PDL": 0}


def test_unknown_trigger_is_refused(monkeypatch):
    monkeypatch.setattr(kernels, "_PDL", 2)
    with pytest.raises(ValueError, match="trigger"):
        kernels.pdl_args("early")
