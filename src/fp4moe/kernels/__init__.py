"""GPU kernels (Triton), one concern per file, each beside the torch reference it is tested against.

Kernels also run on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``), which is how CI checks
them against their references; the interpreter multiplies bf16 tiles wrongly, so under it ``tl.dot``
operands are upcast to fp32 (``DOT_F32``)."""

from __future__ import annotations

import os

try:
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:  # the CPU engine needs no Triton
    HAVE_TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def uint8_view(t):
    """fp8 tensors travel to kernels as bytes (bitcast back inside), which the interpreter also reads."""
    import torch

    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def not_capturing(device, what: str) -> None:
    """Module-level constants must be made outside a CUDA graph capture: made inside, they would live in
    the graph's private pool and only be filled when that graph replays."""
    import torch

    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"{what} first made during a CUDA graph capture; run the step once before capturing"
        )


_UNIT_SCALES: dict = {}


def unit_scale(device):
    """A decode scale of 1 per device, made once (not a fill kernel per call in a captured step; the
    first call runs in the warm-up before capture)."""
    if device not in _UNIT_SCALES:
        import torch

        not_capturing(device, "the unit decode scale")
        _UNIT_SCALES[device] = torch.ones(1, device=device)
    return _UNIT_SCALES[device]


_PDL: int | None = None


def _pdl_level() -> int:
    """0: no programmatic dependent launch; 1: each kernel waits for the one ahead; 2: kernels launched with
    ``trigger`` also let the next kernel start early (``FP4MOE_PDL`` overrides: 0, 1 or 2)."""
    global _PDL
    if _PDL is None:
        import torch

        on = not INTERPRET and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
        value = os.environ.get("FP4MOE_PDL", "2")
        if value not in ("0", "1", "2"):
            raise ValueError(f"FP4MOE_PDL={value!r}: 0 (off), 1 (waits only) or 2 (early triggers, default)")
        _PDL = int(value) if on else 0
    return _PDL


_TRIGGERS = {
    "": 1,
    "start": 2,
    "after_wait": 3,
}  # the kernels' PDL constexpr (``tl_helpers.wait_for_previous``)


def pdl_args(trigger: str = "") -> dict:
    """Launch arguments for programmatic dependent launch (Hopper and later, ``FP4MOE_PDL=0`` turns it off):
    each kernel is launched before the one ahead of it in the stream has finished and waits for it
    (``griddepcontrol.wait``, the kernels' ``PDL`` branch) before it reads anything that kernel or the ones
    before it write -- the launch latency hides behind the previous kernel (H200, a chain of dependent
    launches in a CUDA graph: 1.49 -> 0.97 us per kernel; benchmarks/launch_latency.py). Every kernel that
    takes the attribute must wait, else a kernel two back could still be running. Off under the interpreter.

    ``trigger``: the kernel also releases the next one (``griddepcontrol.launch_dependents``) at its
    "start", or "after_wait" (once the kernel ahead of it is done), so the next kernel's programs are
    resident while this one runs. Any kernel launched with the attribute may load before its wait only
    what no kernel it has not waited for writes -- not this one, not (with "start") the one ahead of it,
    and not even a kernel that just finished without triggering (its writes need not be visible yet): a
    GEMV's weights, the Gated DeltaNet kernel's states, slots and positions; a down GEMV behind an
    "after_wait" gate/up launch also reads its pair's expert, written by the router that gate/up waited for
    (the tensor-core down GEMV: its block's table entries, written by the align kernel or the router).
    Used ahead of such kernels (at any row count: batch 16 and 64 showed no change); triggering along a whole
    chain made each boundary slower (2.1 against 0.96 us in launch_latency.py)."""
    if trigger not in _TRIGGERS:
        raise ValueError(f"unknown trigger {trigger!r}: one of {sorted(_TRIGGERS)}")
    level = _pdl_level()
    if not level:
        return {"PDL": 0}
    pdl = _TRIGGERS[trigger] if level >= 2 else 1
    return {"PDL": pdl, "launch_pdl": True}
