"""NVFP4 math, the single source of truth: E2M1 codes, packing, FP8 block scales, FP32 global scales.

Conventions (NVIDIA ModelOpt, compressed-tensors and vLLM agree on the format):
- E2M1 magnitudes by code 0..7: 0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 of a code is the sign.
- Rounding is round-half-to-even on the magnitude; values beyond +-6 saturate to +-6.
- Two codes per byte along the last (input, K) dimension: element 2i -> low nibble, 2i+1 -> high nibble.
- Blocks of 16 along K, each with one FP8-E4M3 scale; one FP32 global scale per tensor.

The arithmetic is compressed-tensors' float32 order, bit for bit (tests check this against the package):
  global_scale  = 448 * 6 / amax            (NaN/inf -> 1.0, e.g. for an all-zero tensor)
  block_scale   = e4m3(global_scale * block_amax / 6)   (0 -> 0.125, the e4m3 epsilon)
  code          = e2m1(x / (block_scale / global_scale))
ModelOpt stores the reciprocal, ``weight_scale_2 = amax / (6 * 448)``: see ``weight_scale_2_from_amax``.
Every function accepts leading batch dimensions (e.g. experts ``[E, N, K]`` with ``global_scale [E]``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp4moe.errors import UserError
from fp4moe.formats import fp8

FP4_MAX = 6.0
FP8_MAX = fp8.MAX
BLOCK_SIZE = 16
FP8_EPS = 0.125  # torch.finfo(float8_e4m3fn).eps; the scale given to all-zero blocks
FP8_DTYPE = fp8.DTYPE

E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float32)
# signed lookup table by 4-bit code (codes 8..15 are the negatives, 8 being -0.0)
E2M1_TABLE = torch.cat([E2M1_VALUES, -E2M1_VALUES])


class NVFP4Error(UserError, ValueError):
    """Input that cannot be represented in NVFP4 (bad shape, NaN/Inf)."""


@dataclass
class NVFP4Tensor:
    """A quantized weight: ``packed`` uint8 [..., N, K/2], ``block_scales`` e4m3 [..., N, K/16],
    ``global_scale`` float32 [...] (compressed-tensors convention: 448*6/amax)."""

    packed: torch.Tensor
    block_scales: torch.Tensor
    global_scale: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.packed.shape[:-1], self.packed.shape[-1] * 2)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.packed, self.block_scales, self.global_scale, dtype)

    def __getitem__(self, index) -> NVFP4Tensor:
        """Select along the leading (batch) dimensions, e.g. one expert."""
        return NVFP4Tensor(self.packed[index], self.block_scales[index], self.global_scale[index])


def check_quantizable(w: torch.Tensor, name: str = "tensor", group_size: int = BLOCK_SIZE) -> None:
    """Raise NVFP4Error unless ``w`` is a >=2-D float tensor with K % group_size == 0 and no NaN/Inf."""
    if w.ndim < 2:
        raise NVFP4Error(f"{name}: NVFP4 needs a matrix, got shape {tuple(w.shape)}")
    if not w.is_floating_point():
        raise NVFP4Error(f"{name}: expected a floating-point tensor, got {w.dtype}")
    if w.shape[-1] % group_size != 0:
        raise NVFP4Error(
            f"{name}: input dimension {w.shape[-1]} (shape {tuple(w.shape)}) is not divisible by the "
            f"NVFP4 group size {group_size}"
        )
    bad = ~torch.isfinite(w)
    if bad.any():
        num_nan = int(torch.isnan(w).sum())
        num_inf = int(bad.sum()) - num_nan
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise NVFP4Error(f"{name}: {num_nan} NaN and {num_inf} Inf values (first at index {first})")


def global_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """FP32 global (encode) scale 448*6/amax, as compressed-tensors computes it; shape of ``amax``.

    An amax of zero, or one so small that the division overflows, gives 1.0 (no global scaling).
    """
    amax = torch.clamp(amax.float().abs(), min=torch.finfo(torch.float32).tiny)
    return torch.nan_to_num((FP8_MAX * FP4_MAX) / amax, nan=1.0, posinf=1.0, neginf=1.0)


def weight_scale_2_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """ModelOpt's FP32 decode scale amax/(6*448); 1.0 where the global scale fell back to 1.0.

    It equals 1/global_scale_from_amax(amax) within one ulp.
    """
    amax = amax.float().abs()
    overflowed = ~torch.isfinite((FP8_MAX * FP4_MAX) / torch.clamp(amax, min=torch.finfo(torch.float32).tiny))
    return torch.where(overflowed, torch.ones_like(amax), _div(amax, FP8_MAX * FP4_MAX))


def input_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """ModelOpt activation scale amax/(6*448) (compressed-tensors stores its reciprocal)."""
    return _div(amax.float(), FP8_MAX * FP4_MAX)


def _div(x: torch.Tensor, c: float) -> torch.Tensor:
    """x / c, correctly rounded on every device: CUDA turns division by a Python scalar into a multiply by
    its reciprocal (a different last bit, which can flip an e4m3 rounding); a device tensor divisor does not."""
    return x / torch.tensor(c, dtype=x.dtype, device=x.device)


def _blocks(w: torch.Tensor) -> torch.Tensor:
    return w.unflatten(-1, (w.shape[-1] // BLOCK_SIZE, BLOCK_SIZE))  # [..., N, K/16, 16]


def block_amax(w: torch.Tensor) -> torch.Tensor:
    """Per-block absolute maximum, float32 [..., N, K/16]."""
    return _blocks(w).abs().amax(dim=-1).float()


def block_scales_from_amax(block_max: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """E4M3 block scales from block amax [..., N, K/16] and global scale [...]."""
    gs = global_scale.float().reshape(*global_scale.shape, 1, 1)
    # 1. map the block max to the FP4 max, in units of the global scale
    scales = gs * _div(block_max, FP4_MAX)
    # 2. round to e4m3 (saturating: torch's cast overflows to NaN otherwise)
    scales = torch.clamp(scales, -FP8_MAX, FP8_MAX).to(FP8_DTYPE).float()
    # 3. an all-zero block gets the smallest useful scale so decoding never divides by zero
    scales = torch.where(scales == 0, torch.full_like(scales, FP8_EPS), scales)
    return scales.to(FP8_DTYPE)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Round float values to E2M1 codes (uint8 0..15), round-half-to-even, saturating at +-6.

    The sign bit is set for x < 0, so small negatives that round to zero give code 8 ("-0") while
    -0.0 itself gives code 0 -- as both of compressed-tensors' paths (torch and Triton) do.
    """
    a = x.abs()
    # thresholds are the midpoints between neighbours; '>' sends a tie down, '>=' up, so ties land
    # on the even code: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4
    mag = (
        (a > 0.25).to(torch.uint8)
        + (a >= 0.75)
        + (a > 1.25)
        + (a >= 1.75)
        + (a > 2.5)
        + (a >= 3.5)
        + (a > 5.0)
    )
    return mag.to(torch.uint8) | ((x < 0).to(torch.uint8) << 3)


def e2m1_magnitude(a: torch.Tensor) -> torch.Tensor:
    """The E2M1 grid value nearest each float32 of ``a`` in [0, 6], ties to the even code: the values of
    ``e2m1_codes(a)`` without the codes (a new tensor; the scale searches call it once per candidate). From 1
    up the grid is float32 rounded to one mantissa bit: half to even on the bit pattern (add 0x1FFFFF and the
    kept bit, clear the 22 below). Below 1 it is the multiples of 0.5: float32 at 2^22 has a last bit worth
    0.5, so adding 2^22 and taking it off rounds there, half to even. Equal to the codes' values for every
    float32 in [0, 6] (checked exhaustively once; the tests sweep them with a stride and every boundary)."""
    bits = a.view(torch.int32)
    r = bits >> 22
    r &= 1
    r += 0x1FFFFF
    r += bits
    r &= -0x400000
    small = a + 2.0**22
    small -= 2.0**22
    return torch.where(a < 1, small, r.view(torch.float32))


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """Float32 values of E2M1 codes."""
    return E2M1_TABLE.to(codes.device)[codes.long()]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack codes [..., K] (uint8 0..15, K even) into bytes [..., K/2]: element 2i -> low nibble."""
    if codes.shape[-1] % 2:
        raise NVFP4Error(f"cannot pack an odd number of FP4 values ({codes.shape[-1]})")
    if codes.dtype != torch.uint8:
        raise NVFP4Error(f"FP4 codes must be uint8, got {codes.dtype}")
    pairs = codes.unflatten(-1, (codes.shape[-1] // 2, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Unpack bytes [..., K/2] into codes [..., K] (uint8 0..15)."""
    if packed.dtype != torch.uint8:
        raise NVFP4Error(f"packed FP4 data must be uint8, got {packed.dtype}")
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)


def quantize_with_scales(
    w: torch.Tensor, block_scales: torch.Tensor, global_scale: torch.Tensor
) -> torch.Tensor:
    """Packed codes [..., N, K/2] of ``w`` under given block scales and global scale."""
    gs = global_scale.float().reshape(*global_scale.shape, 1, 1, 1)
    effective = block_scales.float().unsqueeze(-1) / gs  # [..., N, K/16, 1]
    scaled = _blocks(w).float() / effective
    scaled = torch.clamp(scaled, -FP4_MAX, FP4_MAX)
    return pack_fp4(e2m1_codes(scaled.flatten(-2)))


def quantize(w: torch.Tensor, global_scale: torch.Tensor | None = None, name: str = "tensor") -> NVFP4Tensor:
    """Round-to-nearest NVFP4 of ``w`` [..., N, K]; one global scale per leading index.

    ``global_scale`` defaults to the one from the amax of each [N, K] matrix (pass a shared one to give
    several matrices, e.g. gate and up of one expert, the same global scale).
    """
    check_quantizable(w, name)
    if global_scale is None:
        global_scale = global_scale_from_amax(w.abs().amax(dim=(-2, -1)))
    global_scale = global_scale.float().reshape(w.shape[:-2])
    scales = block_scales_from_amax(block_amax(w), global_scale)
    return NVFP4Tensor(quantize_with_scales(w, scales, global_scale), scales, global_scale)


def dequantize(
    packed: torch.Tensor,
    block_scales: torch.Tensor,
    global_scale: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Values [..., N, K] of packed codes: code * block_scale / global_scale (compressed-tensors order)."""
    values = e2m1_values(unpack_fp4(packed))  # [..., N, K]
    gs = global_scale.float().reshape(*global_scale.shape, 1, 1, 1)
    scale = block_scales.float().unsqueeze(-1) / gs  # [..., N, K/16, 1]
    return (_blocks(values) * scale).flatten(-2).to(dtype)


def dequantize_modelopt(
    packed: torch.Tensor,
    block_scales: torch.Tensor,
    weight_scale_2: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Values [..., N, K] in ModelOpt's order: code * block_scale * weight_scale_2 (as vLLM decodes)."""
    values = e2m1_values(unpack_fp4(packed))
    s2 = weight_scale_2.float().reshape(*weight_scale_2.shape[: packed.ndim - 2], 1, 1, 1)
    scale = block_scales.float().unsqueeze(-1) * s2
    return (_blocks(values) * scale).flatten(-2).to(dtype)


def fake_quantize(w: torch.Tensor, global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize then dequantize, in ``w``'s dtype."""
    return quantize(w, global_scale).dequantize(w.dtype)
