"""Per-tensor FP8-E4M3, the one place its arithmetic lives: a tensor divided by one fp32 scale, clamped to
e4m3's range (+-448) and rounded to e4m3; decoded as code x scale. Used by the quantizer's ``--quantize
GROUP:fp8`` weights (ModelOpt's FP8: scale = amax / 448), the engine's FP8 linears, and the fp8 KV cache
(scale = amax x headroom / 448 from the first values written). NVFP4's block scales are e4m3 too
(``formats.nvfp4`` uses ``MAX`` and ``DTYPE`` from here)."""

from __future__ import annotations

import torch

MAX = 448.0
DTYPE = torch.float8_e4m3fn


def scale_from_amax(amax: torch.Tensor, headroom: float = 1.0, floor: float | None = None) -> torch.Tensor:
    """amax x headroom / 448 in fp32, at least ``floor`` (default: the smallest normal fp32, so an all-zero
    tensor still has a usable scale)."""
    floor = torch.finfo(torch.float32).tiny if floor is None else floor
    return torch.clamp(amax.float() * headroom / MAX, min=floor)


def encode(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale, saturated to +-448, rounded to e4m3."""
    return torch.clamp(x.float() / scale, -MAX, MAX).to(DTYPE)


def decode(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """e4m3 codes x scale, in ``dtype``."""
    return (x.float() * scale).to(dtype)
