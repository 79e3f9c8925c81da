"""Small Triton device functions shared by the kernels."""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def round_bf16(x):
    """fp32 x rounded to the nearest bf16 (ties to even), kept in fp32: mirrors where the CPU path holds a
    bf16 intermediate. On the bits, on the GPU as under Triton's interpreter (whose casts truncate); NaN
    passes through as NaN, as in torch (the bit formula alone turns the GPU's canonical NaN into -0). A
    conversion there and back (cvt.rn, 2 instructions on sm90 against 4 and a select) broke the q/k norm +
    rotary's bit-exactness against torch on an H100: ``tests/kernels/test_fused_ops.py``."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return tl.where(x == x, bits.to(tl.float32, bitcast=True), x)


@triton.jit
def bf16(x):
    """fp32 x as bf16, rounded to nearest-even (exact after round_bf16)."""
    return round_bf16(x).to(tl.bfloat16)


@triton.jit
def fp8e4m3_bytes(x, SOFT: tl.constexpr = False):
    """fp32 x (already within +-448) as float8-e4m3 bytes, rounded to nearest-even on the fp32 side (adding
    and removing 1.5 * 2^(spacing + 23) rounds to the e4m3 grid) so the cast itself is exact: the
    interpreter's own cast loses the carry into the exponent (126 -> 64). ``SOFT`` (GPUs without e4m3
    conversions, ``gpu_arch``): the bytes by bits instead -- the value on the grid times 2^-8 is an fp16
    (subnormals too) whose low exponent bits and top mantissa bits are the e4m3 code."""
    bits = x.to(tl.uint32, bitcast=True)
    e = ((bits >> 23) & 0xFF).to(tl.int32) - 127
    spacing = tl.maximum(e, -6) - 3
    magic = (((spacing + 150) << 23) | 0x400000).to(tl.uint32).to(tl.float32, bitcast=True)
    y = (x + magic) - magic
    if SOFT:
        h = (y * 0.00390625).to(tl.float16).to(tl.uint16, bitcast=True)
        out = (((h >> 8) & 0x80) | ((h >> 7) & 0x7F)).to(tl.uint8)
    else:
        out = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return out


@triton.jit
def e4m3_to_f16(b):
    """float8-e4m3 bytes -> their fp16 values, exactly, by bits (GPUs without e4m3 conversions, ``gpu_arch``):
    the code's sign, exponent and mantissa under fp16's sign, low exponent bits and top mantissa bits make
    the value times 2^-8 (subnormals included: e4m3's 2^-6 * m/8 lands on fp16's 2^-14 * m/8), and one
    multiply by 256 restores it. e4m3's NaN code (0x7f) comes out as 480: scales and caches hold none."""
    b = b.to(tl.uint16)
    h = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    return (h.to(tl.float16, bitcast=True) * 256.0).to(tl.float16)


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """Under programmatic dependent launch (``kernels.pdl_args``), wait until the kernel ahead in the
    stream has finished and its writes are visible; a no-op otherwise. PDL 2 (``pdl_args("start")``) first
    lets the kernel behind this one launch at once, PDL 3 (``"after_wait"``) right after the wait; its
    programs then wait in their own call of this function, after loading what does not depend on this
    kernel (the GEMVs' first weight tile)."""
    if PDL == 2:
        gdc_launch_dependents()
    if PDL:
        gdc_wait()
    if PDL == 3:
        gdc_launch_dependents()
