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
