"""Grouped NVFP4 (W4A16) expert GEMMs for prefill: row blocks of 64 or 128 (token, expert) pairs of one
expert, with the weights as the tensor-core MMA's first operand -- out^T = W @ A^T per tile.

A program dequantizes one [BN, BK] weight tile in registers (``nvfp4_dequant``; even and odd k interleaved
back into k order) and multiplies it with the block's [BK, BM] activations, which the pipeliner copies
straight from global into shared memory. On sm90 that is a wgmma with its first operand in registers: the
dequantized weights never go through shared memory, and the activations are not loaded into registers
(``nvfp4_gemm._w4a16_kernel`` has the activations first: it stores every dequantized weight tile to shared
memory for the MMA and reads the activations back out). H200, full-size experts, 8,192 tokens per layer:
gate/up 1.02 ms against 1.37, down 0.78 against 0.86 (``benchmarks/tune/tune_prefill_experts.py``); down with two row
tiles a program (WIDE, the default at 128-pair blocks since 2026-12-04) 0.668.

The epilogues are the row kernel's, with its roundings: GATED (1) stores silu(gate) * up of gate rows n and up
rows N + n, WEIGHTED (2) the pair's routing weight times its output; both bf16 per pair. K must be a multiple
of BK (``nvfp4_gemm`` falls back to its row kernel otherwise). Reference: ``nvfp4_gemm.moe_reference``."""

from __future__ import annotations

import os

import triton
import triton.language as tl

from fp4moe.kernels import pdl_args
from fp4moe.kernels.expert_layout import expert_ptrs
from fp4moe.kernels.nvfp4_dequant import dequant_asm, dequant_bf16
from fp4moe.kernels.tl_helpers import round_bf16, wait_for_previous

# the dequantization modes this kernel has (``nvfp4_dequant.DEQUANT_MODE``; FP4MOE_WEIGHTS_FIRST=0: none, every
# prefill block on ``nvfp4_gemm``'s row kernel, for comparisons)
MODES = (1, 7) if os.environ.get("FP4MOE_WEIGHTS_FIRST", "1") != "0" else ()


@triton.jit
def _weights(w_ptrs, s_ptrs, mask, MODE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
             DOT_F32: tl.constexpr):  # fmt: skip
    """One [BN, BK] weight tile in k order: bf16 (mode 7: value * block scale * 2^-8; mode 1: exact), fp32
    under the interpreter."""
    if MODE == 7:
        lo, hi = dequant_asm(w_ptrs, s_ptrs, mask, mask, BN, BK)
        w = tl.reshape(tl.join(lo, hi), (BN, BK))
    else:
        w = dequant_bf16(w_ptrs, s_ptrs, mask, mask, BN, BK)
    if DOT_F32:
        w = w.to(tl.float32)
    return w


@triton.jit
def gated_bf16(acc, acc_up, d_ptr):
    """The GATED epilogue of both grouped kernels (this one and ``nvfp4_gemm``'s row kernel): silu(gate) * up
    from the gate and up accumulators and the expert's two decode scales (at ``d_ptr``), rounded to bf16 where
    the CPU path rounds -- gate, up, silu(gate), the product (fp32 holding bf16 values)."""
    gate = round_bf16(acc * tl.load(d_ptr))
    up = round_bf16(acc_up * tl.load(d_ptr + 1))
    return round_bf16(round_bf16(gate * tl.sigmoid(gate)) * up)


@triton.jit
def weighted_bf16(y, topw):
    """The WEIGHTED epilogue of both grouped kernels: a pair's output y times its routing weight ``topw``
    (broadcast to y's shape), each rounded to bf16 first, as the CPU path holds them."""
    return round_bf16(round_bf16(y) * round_bf16(topw))


@triton.jit
def _prefill_kernel(
    a_ptr, stride_am, w_ptr, s_ptr, d_ptr, out_ptr, stride_om,
    order_ptr, blk_expert_ptr, blk_start_ptr, blk_count_ptr, nblk_ptr, topw_ptr,
    N, K, TOPK, stride_we, stride_wn, stride_se, stride_sn, stride_de,
    MODE: tl.constexpr, EPILOGUE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    EVEN_N: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr, TILE: tl.constexpr = 0,
    WIDE: tl.constexpr = False,
):  # fmt: skip
    wait_for_previous(PDL)
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_b >= tl.load(nblk_ptr):
        return
    e = tl.load(blk_expert_ptr + pid_b)
    start = tl.load(blk_start_ptr + pid_b)
    count = tl.load(blk_count_ptr + pid_b)
    offs_m = tl.arange(0, BM)
    mask_m = offs_m < count
    pairs = tl.load(order_ptr + start + offs_m, mask=mask_m, other=0)
    rows = pairs // TOPK  # gate/up read token rows (TOPK = k), down reads pair rows (TOPK = 1)
    # WIDE (down only): two [BN] row tiles a program, rows n and n + BN, both multiplied with each activation
    # tile it loads -- as gate/up's gate and up rows are -- so a block's activations are read half as often
    offs_n = pid_n * (2 * BN if WIDE else BN) + tl.arange(0, BN)
    w_mask = offs_n[:, None] >= 0 if EVEN_N else offs_n[:, None] < N
    w_mask_up = w_mask if EVEN_N else offs_n[:, None] + BN < N
    offs_k = tl.arange(0, BK)
    w_base = w_ptr + e.to(tl.int64) * stride_we
    s_base = s_ptr + e.to(tl.int64) * stride_se
    a_base = a_ptr + rows[None, :].to(tl.int64) * stride_am
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    acc_up = tl.zeros((BN, BM), dtype=tl.float32)
    for k0 in range(0, K, BK):
        a_t = tl.load(a_base + (k0 + offs_k)[:, None], mask=mask_m[None, :], other=0.0)  # [BK, BM]
        if DOT_F32:
            a_t = a_t.to(tl.float32)
        # the experts' byte order (``expert_layout``)
        w_ptrs, s_ptrs = expert_ptrs(
            w_base, s_base, offs_n, k0, stride_wn, stride_sn, N, BK, EPILOGUE == 1, TILE
        )
        acc = tl.dot(_weights(w_ptrs, s_ptrs, w_mask, MODE, BN, BK, DOT_F32), a_t, acc=acc)
        if EPILOGUE == 1:
            w_ptrs, s_ptrs = expert_ptrs(
                w_base, s_base, offs_n + N, k0, stride_wn, stride_sn, N, BK, True, TILE
            )
            acc_up = tl.dot(_weights(w_ptrs, s_ptrs, w_mask, MODE, BN, BK, DOT_F32), a_t, acc=acc_up)
        elif WIDE:
            w_ptrs, s_ptrs = expert_ptrs(
                w_base, s_base, offs_n + BN, k0, stride_wn, stride_sn, N, BK, False, TILE
            )
            acc_up = tl.dot(_weights(w_ptrs, s_ptrs, w_mask_up, MODE, BN, BK, DOT_F32), a_t, acc=acc_up)
    if MODE == 7:  # the bf16-bit dequantization leaves a factor 2^-8 in the weights
        acc = acc * 256.0
        acc_up = acc_up * 256.0
    out_ptrs = out_ptr + pairs[None, :].to(tl.int64) * stride_om + offs_n[:, None]
    out_mask = mask_m[None, :] & (offs_n[:, None] < N)
    if EPILOGUE == 1:
        y = gated_bf16(acc, acc_up, d_ptr + e * stride_de)
    else:
        topw = tl.load(topw_ptr + pairs, mask=mask_m, other=0.0)
        decode = tl.load(d_ptr + e * stride_de)
        y = weighted_bf16(acc * decode, topw[None, :])
        if WIDE:
            y_up = weighted_bf16(acc_up * decode, topw[None, :])
            tl.store(out_ptrs + BN, y_up.to(out_ptr.dtype.element_ty),
                     mask=mask_m[None, :] & (offs_n[:, None] + BN < N))  # fmt: skip
    tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=out_mask)


def launch(a, w, s, decode, out, routing, topw, n: int, k: int, top_k: int, epilogue: int, mode: int,
           bn: int, bk: int, warps: int, stages: int, dot_f32: bool, tile: int = 0, wide: bool = False):  # fmt: skip
    """One launch over ``routing``'s row blocks: a [rows, K] bf16 (token rows for gate/up, pair rows for
    down), w [E, N (x2 for gate/up), K/2] codes, s the block-scale bytes, decode [E, 2] or [E], out [pairs, N];
    ``tile``: the experts' byte order (``expert_layout``); ``wide`` (down): 2 x ``bn`` weight rows a program."""
    if k % bk:
        raise ValueError(f"K = {k} is not a multiple of the {bk}-wide K tile")
    if epilogue not in (1, 2):
        raise ValueError(f"epilogue {epilogue}: 1 (gated) or 2 (weighted)")
    wide = wide and epilogue == 2
    width = 2 * bn if wide else bn
    _prefill_kernel[(routing.blk_expert.numel(), triton.cdiv(n, width))](
        a, a.stride(0), w, s, decode, out, out.stride(0),
        routing.order, routing.blk_expert, routing.blk_start, routing.blk_count, routing.nblk, topw,
        n, k, top_k, w.stride(0), w.stride(1), s.stride(0), s.stride(1), decode.stride(0),
        MODE=mode, EPILOGUE=epilogue, BM=routing.bm, BN=bn, BK=bk, EVEN_N=n % width == 0, DOT_F32=dot_f32, TILE=tile,
        WIDE=wide,
        num_warps=warps, num_stages=stages, **pdl_args(),
    )  # fmt: skip
    return out
