"""Dequantizing NVFP4 weight tiles in registers, shared by the expert GEMMs (``nvfp4_gemm``,
``nvfp4_moe_prefill``) and the GEMVs (``nvfp4_gemv``, ``nvfp4_mma_gemv``): packed codes [BN, BK/2] (two E2M1
codes per byte, even k in the low nibble) and FP8-E4M3 block scales [BN, BK/16] -> bf16 weights, exactly.
Three ways to the same values (``DEQUANT_MODE`` picks one; ``mode_of`` is a weight tensor's): mode 1 through fp16 bits and fp32
(the interpreter's, and Ampere's: its block scales are converted by bits), mode 4 through bf16 bits with Triton ops, mode 7 through bf16 bits by inline PTX two
codes per instruction (the GPU default). Modes 4 and 7 leave a factor 2^-8 for the accumulator."""

import os

import torch
import triton
import triton.language as tl

from fp4moe.kernels import INTERPRET, gpu_arch
from fp4moe.kernels.tl_helpers import e4m3_to_f16

# 1: interleaved bf16 tiles through fp16 bits and fp32; 4: codes straight into bf16 bits, one bf16 multiply
# by the block scale; 7: the same values two at a time by inline PTX, even and odd k in two dots. All give
# the same weights bit for bit. The default: 7 on the GPU (H200,
# tune_experts: 21.3 / 38.8 / 125 / 244 us per layer at 1 / 3 / 16 / 64 tokens vs mode 4's 23.7 / 50.1 /
# 151 / 310; full-size decode 279 / 1528 / 3446 tok/s at batch 1 / 16 / 64 vs 287 / 1414 / 3076); 1 under
# Triton's interpreter, whose bf16 arithmetic is not IEEE and which runs no PTX. (Even/odd tiles with tf32 or
# bf16 dots through Triton ops were measured slower and removed.) Read it as ``nvfp4_dequant.DEQUANT_MODE``
# (tests and benchmarks set it).
DEQUANT_MODE = int(os.environ.get("FP4MOE_DEQUANT_MODE", "1" if INTERPRET else "7"))


def mode_of(packed: torch.Tensor) -> int:
    """The kernels' MODE for a weight tensor: 0 for bf16 weights, else ``DEQUANT_MODE``, or 1 on a GPU
    without e4m3 conversions (modes 4 and 7 convert the block scales with them; ``gpu_arch``)."""
    if packed.dtype == torch.bfloat16:
        return 0
    if DEQUANT_MODE in (4, 7) and not gpu_arch.has_fp8(packed.device):
        return 1
    return DEQUANT_MODE


def block_k(k: int, cap: int = 128) -> int:
    """The K tile of a dequantized weight tile: the largest power of two <= ``cap`` dividing K, at least 32
    (a 16-wide tile has one block scale per row and miscomputed on the H200; K = 48 then runs a masked ragged
    tile). NVFP4 needs K % 16 == 0."""
    if k % 16:
        raise ValueError(f"input dimension {k} is not a multiple of 16")
    bk = cap
    while k % bk and bk > 32:
        bk //= 2
    return bk


@triton.jit
def dequant_bf16(w_ptrs, s_ptrs, w_mask, s_mask, BN: tl.constexpr, BK: tl.constexpr):
    """MODE 1: packed codes [BN, BK/2] and block scales [BN, BK/16] -> interleaved [BN, BK] bf16 tile
    (code -> fp16 bits with the exponent 14 too small -> fp32, times scale * 2^14 -> bf16, exact)."""
    return dequant_bf16_of(
        tl.load(w_ptrs, mask=w_mask, other=0), tl.load(s_ptrs, mask=s_mask, other=0), BN, BK
    )


@triton.jit
def dequant_bf16_of(packed, sbytes, BN: tl.constexpr, BK: tl.constexpr):
    """``dequant_bf16`` of codes and scale bytes already loaded."""
    packed = packed.to(tl.uint16)
    codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), (BN, BK))  # even k from the low nibble
    bits = ((codes & 8) << 12) | ((codes & 7) << 9)
    vals = bits.to(tl.float16, bitcast=True).to(tl.float32)
    scales = e4m3_to_f16(sbytes).to(tl.float32) * 16384.0  # by bits: the mode Ampere runs (``gpu_arch``)
    w = tl.reshape(vals, (BN, BK // 16, 16)) * scales[:, :, None]
    return tl.reshape(w, (BN, BK)).to(tl.bfloat16)


@triton.jit
def dequant_bf16_bits(w_ptrs, s_ptrs, w_mask, s_mask, BN: tl.constexpr, BK: tl.constexpr):
    """MODE 4: packed codes [BN, BK/2] -> interleaved [BN, BK] bf16 tile of value * block scale * 2^-8,
    exact, with no conversion instruction per element: the code's e1 e0 m bits go into the low exponent
    bits and the top mantissa bit of a bf16 (that is the E2M1 value times 2^-126), and one bf16 multiply
    by scale * 2^118 (the 2^8 left over goes on the accumulator)."""
    packed, sbytes = tl.load(w_ptrs, mask=w_mask, other=0), tl.load(s_ptrs, mask=s_mask, other=0)
    return dequant_bf16_bits_of(packed, sbytes, BN, BK)


@triton.jit
def dequant_bf16_bits_of(packed, sbytes, BN: tl.constexpr, BK: tl.constexpr):
    """``dequant_bf16_bits`` of codes and scale bytes already loaded."""
    packed = packed.to(tl.uint16)
    codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), (BN, BK))  # even k from the low nibble
    vals = (((codes & 8) << 12) | ((codes & 7) << 6)).to(tl.bfloat16, bitcast=True)
    scales = sbytes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    scales = (scales * 3.3230699894622794e35).to(tl.bfloat16)  # * 2^118: exact
    w = tl.reshape(vals, (BN, BK // 16, 16)) * scales[:, :, None]
    return tl.reshape(w, (BN, BK))


# E2M1 nibbles -> bf16 bits of value * 2^-126 (as in mode 4), four bytes per 32-bit register, two values
# per instruction: spread bytes 0,1 (2,3) to the low bytes of the two halves of a register (prmt), keep one
# nibble per half, and one multiply by 2^6 + 2^12 (low nibble; 2^2 + 2^8 for the high one) puts copies of
# the nibble at bits 6-9 and 12-15 of each half (they cannot overlap); the mask keeps e1 e0 m under the
# bf16's low exponent bits / top mantissa bit (6-8) and the sign at bit 15. Outputs $0,$1: the low nibbles
# of bytes 0,1 and 2,3; $2,$3: the high nibbles
E2M1_BOTH = tl.constexpr("""{
.reg .b32 r<4>;
prmt.b32 r0, $4, 0, 0x4140;
prmt.b32 r1, $4, 0, 0x4342;
and.b32 r2, r0, 0x000F000F;
and.b32 r3, r1, 0x000F000F;
mul.lo.u32 r2, r2, 0x1040;
mul.lo.u32 r3, r3, 0x1040;
and.b32 $0, r2, 0x81C081C0;
and.b32 $1, r3, 0x81C081C0;
and.b32 r2, r0, 0x00F000F0;
and.b32 r3, r1, 0x00F000F0;
mul.lo.u32 r2, r2, 0x104;
mul.lo.u32 r3, r3, 0x104;
and.b32 $2, r2, 0x81C081C0;
and.b32 $3, r3, 0x81C081C0;
}""")


@triton.jit
def dequant_asm(w_ptrs, s_ptrs, w_mask, s_mask, BN: tl.constexpr, BK: tl.constexpr):
    """MODE 7: packed codes [BN, BK/2] -> (even k, odd k) tiles [BN, BK/2] bf16 of value * block scale *
    2^-8, exactly mode 4's values, with the nibbles converted two at a time by inline PTX (GPU only)."""
    return dequant_asm_of(
        tl.load(w_ptrs, mask=w_mask, other=0), tl.load(s_ptrs, mask=s_mask, other=0), BN, BK
    )


@triton.jit
def dequant_asm_of(packed, sbytes, BN: tl.constexpr, BK: tl.constexpr):
    """``dequant_asm`` of codes and scale bytes already loaded."""
    lo, hi = tl.inline_asm_elementwise(
        E2M1_BOTH, "=r,=r,=r,=r,r", [packed], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4
    )
    scales = sbytes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    scales = (scales * 3.3230699894622794e35).to(tl.bfloat16)  # * 2^118: exact
    scales = tl.reshape(tl.broadcast_to(scales[:, :, None], (BN, BK // 16, 8)), (BN, BK // 2))
    return lo * scales, hi * scales
