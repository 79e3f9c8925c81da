"""The order of NVFP4 expert bytes in GPU memory: row-major as in the checkpoint, or tiled (``tile_experts``).

A decode step reads ~100 experts per layer at 16 tokens. In the checkpoint's row-major order [E, R, K/2] a
tensor-core GEMV program (``nvfp4_mma_gemv``) reads, at each K step, a short run of every one of its rows --
64-128 bytes at a stride of K/2 -- so DRAM serves many short bursts from many pages. Tiled, the rows a program
reads at one step lie next to each other: per expert, per tile of rows (16 gate rows then the same 16 up rows,
or 16 down rows), per K step of ``step`` bytes, the tile's rows of that step contiguous (2 KB for gate/up at
64-byte steps). H200, full-size experts, the same launches on both orders (``benchmarks/tune/tune_experts.py
--tiled``): 16 tokens 51.1 + 28.2 us per layer row-major against 40.2 + 24.8 tiled (2.3 against 2.8 TB/s of
distinct experts), 64 tokens 102.7 + 58.1 against 82.1 + 50.0.

Scales follow the same order at ``step / 8`` bytes (one FP8 byte per 16 weights). Every kernel that reads
expert weights takes the order as a constexpr (``TILE``: the step, 0 for row-major) and addresses them through
``tiled_offsets`` (the Gluon GEMV spells the same arithmetic in its own language); the torch references take
row-major weights (``untile_experts``)."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

TILE_ROWS = 16  # rows of a tile: 16 gate rows then their 16 up rows, or 16 down rows

# FP4MOE_TILED_EXPERTS=0: the GPU engine keeps the checkpoint's row-major order (for comparisons)
ENABLED = os.environ.get("FP4MOE_TILED_EXPERTS", "1") != "0"


def step_for(hidden: int, inter: int) -> int:
    """The tile step for experts of this shape: 64 bytes (the tensor-core GEMV's best at 16 and 64 tokens) where
    both K halves divide into it, else 32; 0 where a tile does not fit (K or rows not multiples of 64)."""
    if hidden % 64 or inter % 64:
        return 0
    return 64 if hidden % 128 == 0 and inter % 128 == 0 else 32


def _order(x: torch.Tensor, width: int, gated: bool, forward: bool) -> torch.Tensor:
    """x [E, R, C] with C a multiple of ``width`` -> its rows' runs of ``width`` in tile order (``forward``) or
    back to row-major."""
    e, r, c = x.shape
    steps = c // width
    if gated:  # [E, 2 (gate, up), R/32, 16, steps, width] <-> [E, R/32, steps, 2, 16, width]
        row_major, tiled = (e, 2, r // 32, TILE_ROWS, steps, width), (e, r // 32, steps, 2, TILE_ROWS, width)
        to_tiled, to_rows = (0, 2, 4, 1, 3, 5), (0, 3, 1, 4, 2, 5)
    else:  # [E, R/16, 16, steps, width] <-> [E, R/16, steps, 16, width]
        row_major, tiled = (
            (e, r // TILE_ROWS, TILE_ROWS, steps, width),
            (e, r // TILE_ROWS, steps, TILE_ROWS, width),
        )
        to_tiled = to_rows = (0, 1, 3, 2, 4)
    if forward:
        return x.reshape(row_major).permute(to_tiled).reshape(e, r, c).contiguous()
    return x.reshape(tiled).permute(to_rows).reshape(e, r, c).contiguous()


def _reorder(packed: torch.Tensor, scales: torch.Tensor, step: int, gated: bool, forward: bool):
    e, r, kb = packed.shape
    if step not in (32, 64) or kb % step or r % (2 * TILE_ROWS if gated else TILE_ROWS):
        raise ValueError(f"experts {tuple(packed.shape)} do not tile at {step}-byte steps (gated: {gated})")
    s = _order(scales.view(torch.uint8), step // 8, gated, forward).view(scales.dtype)
    return _order(packed, step, gated, forward), s


def tile_experts(packed: torch.Tensor, scales: torch.Tensor, step: int, gated: bool):
    """packed [E, R, K/2] uint8, scales [E, R, K/16] (FP8) row-major -> both in tile order (new tensors of the
    same shapes and dtypes). ``gated``: gate/up weights (rows R/2 onwards are the up rows)."""
    return _reorder(packed, scales, step, gated, True)


def untile_experts(packed: torch.Tensor, scales: torch.Tensor, step: int, gated: bool):
    """``tile_experts``' inverse."""
    return _reorder(packed, scales, step, gated, False)


@triton.jit
def tiled_offsets(rows, cols, row_stride, half, GATED: tl.constexpr, STEP: tl.constexpr):
    """Byte offsets [R, C] inside one expert of rows ``rows`` [R] and columns ``cols`` [C] (packed bytes, or
    scale bytes with STEP / 8): row-major (STEP 0: row * row_stride + col) or ``tile_experts``' order.
    GATED: gate/up weights, rows >= ``half`` the up rows."""
    if STEP == 0:
        off = rows[:, None] * row_stride + cols[None, :]
    else:
        if GATED:
            up = (rows >= half).to(rows.dtype)
            n = rows - up * half
            row_off = (n // 16) * (32 * row_stride) + (up * 16 + n % 16) * STEP
            col_off = (cols // STEP) * (32 * STEP) + cols % STEP
        else:
            row_off = (rows // 16) * (16 * row_stride) + (rows % 16) * STEP
            col_off = (cols // STEP) * (16 * STEP) + cols % STEP
        off = row_off[:, None] + col_off[None, :]
    return off


@triton.jit
def expert_ptrs(w_e, s_e, rows, k0, stride_wn, stride_sn, half, BK: tl.constexpr, GATED: tl.constexpr,
                TILE: tl.constexpr):  # fmt: skip
    """Pointers to one [rows, BK] K tile from weight k0 of one expert's NVFP4 codes at ``w_e`` [rows, BK/2]
    and block-scale bytes at ``s_e`` [rows, BK/16], in the order TILE says (``tiled_offsets``)."""
    w_ptrs = w_e + tiled_offsets(rows, k0 // 2 + tl.arange(0, BK // 2), stride_wn, half, GATED, TILE)
    s_ptrs = s_e + tiled_offsets(rows, k0 // 16 + tl.arange(0, BK // 16), stride_sn, half, GATED, TILE // 8)
    return w_ptrs, s_ptrs
