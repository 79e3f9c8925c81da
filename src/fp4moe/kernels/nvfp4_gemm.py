"""NVFP4 weight-only (W4A16) GEMMs: the routed experts of an MoE layer, grouped by expert, and a dense
NVFP4 linear (one "expert", every row).

Weights stay packed ([E, N, K/2] uint8, two E2M1 codes per byte, even element in the low nibble),
with FP8-E4M3 block scales per 16 along K and one FP32 decode scale per projection. A program dequantizes
one [BN, BK] weight tile in registers, exactly (``DEQUANT_MODE`` 7, the GPU default: inline PTX writes two
codes' bits into bf16s per instruction, one bf16 multiply by the block scale, even and odd k as two half
tiles; mode 4: the same bits through Triton ops; mode 1, the interpreter's: code -> fp16 bits -> fp32, times
the block scale -> bf16), multiplies it with up to BM activation rows on the tensor cores, and applies the
decode scale once to the fp32 accumulator. BK divides K where a power of two >= 32 does, else the last K
tile is masked. Rows are (token, expert) pairs sorted by expert; a block table says which expert and which
run of sorted pairs each program row-block covers (``align``). Prefill-sized blocks (64 or 128 pairs) go to
``nvfp4_moe_prefill``'s kernel, which takes the weights as the MMA's first operand (``Tiles.weights_first``,
``plan``); this row kernel keeps decode-sized blocks, bf16 and FP8 weights, split K and ragged K.

Gate/up programs compute the gate rows n and the up rows I + n of one expert together and store
silu(gate) * up; down programs multiply by the pair's routing weight. Optionally (``Tiles.split``) the
gate/up launch splits K into ranges and stores fp32 partial sums, and the down launch computes the
activation as it loads them (measured slower end to end on the H200: the down launch recomputes the
activation for every output tile; kept as a tuning option). References: ``moe_reference``,
``linear_reference`` (the engine's CPU path through ``formats.nvfp4``).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from fp4moe.formats import nvfp4
from fp4moe.kernels import INTERPRET, next_pow2, pdl_args, uint8_view
from fp4moe.kernels import nvfp4_moe_prefill as prefill
from fp4moe.kernels.nvfp4_dequant import dequant_asm, dequant_bf16, dequant_bf16_bits
from fp4moe.kernels.tl_helpers import round_bf16, wait_for_previous


@triton.jit
def _dot(a, w, DOT_F32: tl.constexpr):
    """a [BM, K] @ w [BN, K]^T in fp32 (bf16 operands; fp32 ones under the interpreter)."""
    if DOT_F32:
        return tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)))
    return tl.dot(a.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)))


@triton.jit
def _load_a(a_base, k_idx, mask, K, stride_as, ACT_SPLITS: tl.constexpr):
    """The activation tile [BM, BK] at columns ``k_idx``: bf16 rows, or (ACT_SPLITS > 0) silu(gate) * up
    computed from the gate/up partial sums of a split gate/up launch (fp32 [splits, pairs, 2K], summed in
    split order, then rounded where the CPU path rounds: gate, up, silu(gate), the product)."""
    if ACT_SPLITS == 0:
        a = tl.load(a_base + k_idx, mask=mask, other=0.0)
    else:  # (the compiler needs both branches to end in one return)
        gate = tl.load(a_base + k_idx, mask=mask, other=0.0)
        up = tl.load(a_base + K + k_idx, mask=mask, other=0.0)
        for s in tl.static_range(1, ACT_SPLITS):
            gate += tl.load(a_base + s * stride_as + k_idx, mask=mask, other=0.0)
            up += tl.load(a_base + s * stride_as + K + k_idx, mask=mask, other=0.0)
        gate = round_bf16(gate)
        act = round_bf16(gate * tl.sigmoid(gate))
        a = round_bf16(act * round_bf16(up)).to(tl.bfloat16)
    return a


@triton.jit
def _tile_dot(a, k0, K, w_ptrs, s_ptrs, mask_n, offs_k, offs_kh, offs_ks,
              MODE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
              DOT_F32: tl.constexpr):  # fmt: skip
    """One K tile's contribution a @ W[n, k0:k0+BK]^T -> [BM, BN] fp32 (masked along K unless EVEN_K:
    every load past K reads zeros, so a ragged last tile adds nothing)."""
    if EVEN_K:
        k_ok = offs_k >= 0
        kh_ok = offs_kh >= 0
        ks_ok = offs_ks >= 0
    else:
        k_ok = k0 + offs_k < K
        kh_ok = k0 + 2 * offs_kh < K
        ks_ok = k0 + 16 * offs_ks < K
    w_mask = mask_n[:, None] & kh_ok[None, :]
    s_mask = mask_n[:, None] & ks_ok[None, :]
    if MODE == 7:  # even and odd k apart: two dots over half tiles
        lo, hi = dequant_asm(w_ptrs, s_ptrs, w_mask, s_mask, BN, BK)
        a_even, a_odd = tl.split(tl.reshape(a, (a.shape[0], BK // 2, 2)))
        out = tl.dot(a_odd, tl.trans(hi), acc=tl.dot(a_even, tl.trans(lo)))
    else:
        if MODE == 0:  # bf16 weights (the all-bf16 model through the same kernel)
            w = tl.load(w_ptrs, mask=mask_n[:, None] & k_ok[None, :], other=0.0)
        elif (
            MODE == 3
        ):  # per-tensor FP8-E4M3 weights (bytes): exact in bf16, the scale goes on the accumulator
            w = tl.load(w_ptrs, mask=mask_n[:, None] & k_ok[None, :], other=0)
            w = w.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
        elif MODE == 4:
            w = dequant_bf16_bits(w_ptrs, s_ptrs, w_mask, s_mask, BN, BK)
        else:
            w = dequant_bf16(w_ptrs, s_ptrs, w_mask, s_mask, BN, BK)
        out = _dot(a, w, DOT_F32)
    return out


@triton.jit
def _w4a16_kernel(
    a_ptr,
    stride_am,
    stride_as,
    w_ptr,
    s_ptr,
    d_ptr,
    out_ptr,
    stride_om,
    stride_os,
    order_ptr,
    blk_expert_ptr,
    blk_start_ptr,
    blk_count_ptr,
    nblk_ptr,
    topw_ptr,
    M,
    N,
    K,
    K_SPLIT,
    TOPK,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_de,
    DENSE: tl.constexpr,
    MODE: tl.constexpr,
    EPILOGUE: tl.constexpr,
    ACT_SPLITS: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_F32: tl.constexpr,
    PDL: tl.constexpr,
):
    """EPILOGUE 0: y = acc * decode (dense); 1 (GATED): silu(gate) * up from the gate rows n and up rows
    N + n; 2 (WEIGHTED): y * the pair's routing weight; 3 (PARTIAL): acc * decode of rows n < N/2 (gate)
    or >= N/2 (up), fp32, for K range ``program_id(2) * K_SPLIT`` onwards, into split plane
    ``program_id(2)`` of ``out``. ACT_SPLITS > 0: the A operand is computed from such partials."""
    wait_for_previous(PDL)
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_m = tl.arange(0, BM)
    if DENSE:
        e = pid_b * 0
        count = tl.minimum(M - pid_b * BM, BM)
        rows = pid_b * BM + offs_m
        mask_m = offs_m < count
        pairs = rows
    else:
        if pid_b >= tl.load(nblk_ptr):
            return
        e = tl.load(blk_expert_ptr + pid_b)
        start = tl.load(blk_start_ptr + pid_b)
        count = tl.load(blk_count_ptr + pid_b)
        mask_m = offs_m < count
        pairs = tl.load(order_ptr + start + offs_m, mask=mask_m, other=0)
        rows = pairs // TOPK  # gate/up read token rows (TOPK = k), down reads pair rows (TOPK = 1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask_n = offs_n < N
    offs_kh = tl.arange(0, BK // 2)
    offs_ks = tl.arange(0, BK // 16)
    offs_k = tl.arange(0, BK)
    w_base = w_ptr + e.to(tl.int64) * stride_we
    s_base = s_ptr + e.to(tl.int64) * stride_se
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    acc_up = tl.zeros((BM, BN), dtype=tl.float32)
    a_base = a_ptr + rows[:, None].to(tl.int64) * stride_am
    k_lo = pid_s * K_SPLIT
    for k0 in range(k_lo, k_lo + K_SPLIT, BK):
        if MODE == 0 or MODE == 3:
            w_ptrs = w_base + offs_n[:, None] * stride_wn + (k0 + offs_k)[None, :]
            s_ptrs = w_ptrs
        else:
            w_ptrs = w_base + offs_n[:, None] * stride_wn + (k0 // 2 + offs_kh)[None, :]
            s_ptrs = s_base + offs_n[:, None] * stride_sn + (k0 // 16 + offs_ks)[None, :]
        a_mask = mask_m[:, None] & ((k0 + offs_k < K)[None, :] if not EVEN_K else (offs_k >= 0)[None, :])
        a = _load_a(a_base, (k0 + offs_k)[None, :], a_mask, K, stride_as, ACT_SPLITS)
        acc += _tile_dot(
            a, k0, K, w_ptrs, s_ptrs, mask_n, offs_k, offs_kh, offs_ks, MODE, BN, BK, EVEN_K, DOT_F32
        )
        if EPILOGUE == 1:
            acc_up += _tile_dot(
                a, k0, K, w_ptrs + N * stride_wn, s_ptrs + N * stride_sn, mask_n, offs_k, offs_kh, offs_ks,
                MODE, BN, BK, EVEN_K, DOT_F32,
            )  # fmt: skip
    if MODE >= 4:  # the bf16-bit dequantization leaves a factor 2^-8 in the weights
        acc = acc * 256.0
        acc_up = acc_up * 256.0
    out_ptrs = (
        out_ptr + pid_s.to(tl.int64) * stride_os + pairs[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    )
    out_mask = mask_m[:, None] & mask_n[None, :]
    if EPILOGUE == 3:  # fp32 partial sums, decode scale of the gate or the up half applied
        d = tl.load(d_ptr + e * stride_de + (offs_n >= N // 2).to(tl.int32), mask=mask_n, other=0.0)
        tl.store(out_ptrs, acc * d[None, :], mask=out_mask)
    elif EPILOGUE == 1:
        y = prefill.gated_bf16(acc, acc_up, d_ptr + e * stride_de)
        tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        y = acc * tl.load(d_ptr + e * stride_de)
        if EPILOGUE == 2:
            topw = tl.load(topw_ptr + pairs, mask=mask_m, other=0.0)
            y = prefill.weighted_bf16(y, topw[:, None])
        tl.store(out_ptrs, round_bf16(y).to(out_ptr.dtype.element_ty), mask=out_mask)


# ---- routing: (token, expert) pairs sorted by expert, and the block table --------------------------------


# the pair count unspecialized: one variant per TKP, not two (the GPU no-compile test found the block size and
# the count's divisibility by 16 combining into variants the warm-up had not met)
@triton.jit(do_not_specialize=["TK"])
def _align_kernel(
    ids_ptr,
    TK,
    order_ptr,
    blk_expert_ptr,
    blk_start_ptr,
    blk_count_ptr,
    nblk_ptr,
    E: tl.constexpr,
    BM: tl.constexpr,
    TKP: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program: the pairs sorted by (expert, pair index) -- one bitonic sort of expert * TKP + pair --
    then the block table, one entry per BM pairs of an expert, written expert by expert. Entries past
    ``nblk`` are left as they were (the expert kernel stops at ``nblk``)."""
    wait_for_previous(PDL)
    offs = tl.arange(0, TKP)
    live = offs < TK
    ids = tl.load(ids_ptr + offs, mask=live, other=E)  # padding sorts after every expert
    keys = tl.sort(ids * TKP + offs)
    tl.store(order_ptr + offs, keys % TKP, mask=live)
    counts = tl.histogram(ids, E, mask=live)
    experts = tl.arange(0, E)
    starts = tl.cumsum(counts, 0) - counts
    nb = (counts + BM - 1) // BM
    bstart = tl.cumsum(nb, 0) - nb
    tl.store(nblk_ptr, tl.sum(nb, 0))
    for j in range(0, tl.max(nb, 0)):
        has = nb > j
        tl.store(blk_expert_ptr + bstart + j, experts, mask=has)
        tl.store(blk_start_ptr + bstart + j, starts + j * BM, mask=has)
        tl.store(blk_count_ptr + bstart + j, tl.minimum(counts - j * BM, BM), mask=has)


def max_blocks(num_pairs: int, num_experts: int, bm: int) -> int:
    return num_pairs // bm + min(num_pairs, num_experts)


class Routing:
    """Pairs sorted by expert and the block table, in device tensors (static shapes: graph-capturable)."""

    def __init__(self, order, blk_expert, blk_start, blk_count, nblk, bm: int):
        self.order, self.blk_expert, self.blk_start, self.blk_count, self.nblk = (
            order,
            blk_expert,
            blk_start,
            blk_count,
            nblk,
        )
        self.bm = bm


def align(topk_ids: torch.Tensor, num_experts: int, bm: int, num_warps: int | None = None) -> Routing:
    """topk_ids [T, k] -> Routing. One program for up to ``ALIGN_MAX_PAIRS`` pairs (decode, speculative
    verification, small prefill chunks); torch sorting otherwise."""
    tk = topk_ids.numel()
    if tk > ALIGN_MAX_PAIRS:
        return align_reference(topk_ids, num_experts, bm)
    maxb = max_blocks(tk, num_experts, bm)
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int32)
    order = torch.empty(tk, dtype=torch.int32, device=dev)
    # rows padded to 16 bytes: Triton specializes on each pointer's 16-byte alignment, and rows of an odd
    # width made a new variant of this kernel and of the expert GEMMs for many token counts -- compiled on
    # a user's request (64% of the H200 server's engine thread at 16 streams, TTFT 5 s)
    blk = torch.empty(3, -(-maxb // 4) * 4, dtype=torch.int32, device=dev)[:, :maxb]
    nblk = torch.empty(1, dtype=torch.int32, device=dev)
    tkp = next_pow2(tk)
    _align_kernel[(1,)](
        flat, tk, order, blk[0], blk[1], blk[2], nblk, E=next_pow2(num_experts), BM=bm, TKP=tkp,
        num_warps=num_warps or (4 if tkp <= 512 else 8), **pdl_args(),
    )  # fmt: skip
    return Routing(order, blk[0], blk[1], blk[2], nblk, bm)


ALIGN_MAX_PAIRS = 4096
PAIR_ROUTING_MAX_TOKENS = 4  # up to this many tokens, every pair is its own row block (no sort)
_PAIR_TABLES: dict[tuple[int, torch.device], tuple[torch.Tensor, ...]] = {}


def pair_routing(topk_ids: torch.Tensor, bm: int) -> Routing:
    """Routing with one row block per (token, expert) pair, in pair order: the block table is the router's
    own output, so nothing is sorted -- for a few tokens, where an align launch costs more than reading an
    expert twice when two tokens share it. The constant tables are made once per size and device (in the
    warm-up before a graph capture)."""
    tk, dev = topk_ids.numel(), topk_ids.device
    if (tk, dev) not in _PAIR_TABLES:
        _not_capturing(dev, "pair_routing's tables")
        rows = torch.arange(tk, dtype=torch.int32, device=dev)
        _PAIR_TABLES[(tk, dev)] = (
            rows, torch.ones(tk, dtype=torch.int32, device=dev), torch.full((1,), tk, dtype=torch.int32, device=dev)
        )  # fmt: skip
    rows, ones, nblk = _PAIR_TABLES[(tk, dev)]
    return Routing(rows, topk_ids.reshape(-1).to(torch.int32), rows, ones, nblk, bm)


def align_reference(topk_ids: torch.Tensor, num_experts: int, bm: int) -> Routing:
    """The same tables with torch ops (used for prefill-sized batches, and as the reference)."""
    flat = topk_ids.reshape(-1).long()
    tk = flat.numel()
    dev = flat.device
    maxb = max_blocks(tk, num_experts, bm)
    order = torch.sort(flat, stable=True).indices.to(torch.int32)
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(
        0, flat, torch.ones_like(flat)
    )
    starts = torch.cumsum(counts, 0) - counts
    nb = (counts + bm - 1) // bm
    bend = torch.cumsum(nb, 0)
    b = torch.arange(maxb, device=dev)
    e = torch.searchsorted(bend, b, right=True).clamp(max=num_experts - 1)
    j = b - (bend[e] - nb[e])
    total = bend[-1]
    valid = b < total
    start = torch.where(valid, starts[e] + j * bm, 0)
    cnt = torch.where(valid, (counts[e] - j * bm).clamp(max=bm), 0)  # (no host tensor: no copy, no wait)
    return Routing(
        order,
        torch.where(valid, e, 0).to(torch.int32),
        start.to(torch.int32),
        cnt.to(torch.int32),
        total.reshape(1).to(torch.int32),
        bm,
    )


# ---- launchers ----------------------------------------------------------------------------------------


# 1: interleaved bf16 tiles through fp16 bits and fp32; 4: codes straight into bf16 bits, one bf16 multiply
# by the block scale; 7: the same values two at a time by inline PTX, even and odd k in two dots. All give
# the same weights bit for bit. The default: 7 on the GPU (H200,
# tune_experts: 21.3 / 38.8 / 125 / 244 us per layer at 1 / 3 / 16 / 64 tokens vs mode 4's 23.7 / 50.1 /
# 151 / 310; full-size decode 279 / 1528 / 3446 tok/s at batch 1 / 16 / 64 vs 287 / 1414 / 3076); 1 under
# Triton's interpreter, whose bf16 arithmetic is not IEEE and which runs no PTX. (Even/odd tiles with tf32 or
# bf16 dots through Triton ops were measured slower and removed.)
DEQUANT_MODE = int(os.environ.get("FP4MOE_DEQUANT_MODE", "1" if INTERPRET else "7"))
GATED, WEIGHTED, PARTIAL = 1, 2, 3  # the kernel's EPILOGUE (0: dense)
# the dequantizations nvfp4_moe_prefill's kernel has (FP4MOE_WEIGHTS_FIRST=0: none, every prefill block on the
# row kernel, for comparisons)
WEIGHTS_FIRST_MODES = (1, 7) if os.environ.get("FP4MOE_WEIGHTS_FIRST", "1") != "0" else ()


def _mode(packed: torch.Tensor) -> int:
    return 0 if packed.dtype == torch.bfloat16 else DEQUANT_MODE


def block_m(num_tokens: int, top_k: int, num_experts: int, weights_first: bool | None = None) -> int:
    """Rows per expert block: 16 (the smallest tensor-core tile) for decode, up to 64 for prefill; 128 where
    experts get at least 128 pairs each and the weights-first kernel runs (``plan``; ``weights_first`` None:
    whether ``DEQUANT_MODE`` has it)."""
    per_expert = num_tokens * top_k / num_experts
    if weights_first is None:
        weights_first = DEQUANT_MODE in WEIGHTS_FIRST_MODES
    if per_expert >= 128 and weights_first:
        return 128
    return 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64


def _block_k(k: int, cap: int = 128) -> int:
    """The largest power of two <= ``cap`` dividing K, at least 32 (a 16-wide tile has one block scale
    per row and miscomputed on the H200; K = 48 then runs a masked ragged tile). NVFP4 needs K % 16 == 0."""
    if k % 16:
        raise ValueError(f"input dimension {k} is not a multiple of 16")
    bk = cap
    while k % bk and bk > 32:
        bk //= 2
    return bk


class Tiles:
    """Launch settings of one expert GEMM: output tile width BN, K tile BK (a cap: the largest power of
    two dividing the K range), warps, pipeline stages, and the number of K splits (gate/up only: 0 fuses
    silu(gate) * up into the launch; s >= 1 writes fp32 partial sums of s K ranges, gate and up rows in
    separate programs, and the down launch computes the activation from them). ``weights_first``: the
    launch runs ``nvfp4_moe_prefill``'s kernel (weights as the MMA's first operand; no split, K a multiple
    of BK, dequantization mode 1 or 7), else it falls back to the row kernel with the same tiles."""

    def __init__(
        self, bn: int, bk: int, warps: int, stages: int, split: int = 0, weights_first: bool = False
    ):
        self.bn, self.bk, self.warps, self.stages, self.split = bn, bk, warps, stages, split
        self.weights_first = weights_first

    def __repr__(self) -> str:
        return (
            f"Tiles(bn={self.bn}, bk={self.bk}, warps={self.warps}, stages={self.stages}, split={self.split}, "
            f"weights_first={self.weights_first})"
        )


def plan(bm: int, tokens: int, mode: int | None = None) -> tuple[Tiles, Tiles]:
    """(gate/up, down) launch settings for a row block of ``bm`` and ``tokens`` tokens in the launch (H200
    sweep, benchmarks/tune_experts.py: graph-replayed launches over 40 layers' experts; prefill blocks:
    benchmarks/tune_prefill_experts.py), for dequantization ``mode`` (default ``DEQUANT_MODE``)."""
    if bm <= 16 and tokens <= 1:
        return Tiles(32, 256, 4, 3), Tiles(32, 128, 2, 3)
    if bm <= 16 and tokens <= 4:
        return Tiles(64, 256, 4, 3), Tiles(64, 128, 4, 2)
    if bm <= 16:
        return Tiles(64, 256, 4, 3), Tiles(64, 128, 4, 3)
    if bm >= 64 and (DEQUANT_MODE if mode is None else mode) in WEIGHTS_FIRST_MODES:
        # H200, 8,192 tokens (bm 128): gate/up 1.02 ms, down 0.78 ms per layer against the row kernel's best
        # 1.37 and 0.86; 2,048 tokens (bm 64): 0.45 and 0.27 against 0.47 and 0.28
        down = (
            Tiles(64, 128, 4, 3, weights_first=True) if bm >= 128 else Tiles(64, 64, 4, 3, weights_first=True)
        )
        return Tiles(64, 128, 4, 2, weights_first=True), down
    if bm >= 64:  # prefill (8K tokens: down 1.02 ms per layer against 1.32 with the gate/up's tiles)
        return Tiles(64, 128, 4, 3), Tiles(128, 64, 4, 3)
    return Tiles(64, 128, 4, 3), Tiles(64, 128, 4, 3)


def _launch(a, a_strides, act_splits, w, s, stride_sn, decode, out, routing, topw, n, k, top_k, epilogue,
            mode, t: Tiles, split: int = 1, dense_m: int = 0):  # fmt: skip
    """One ``_w4a16_kernel`` launch: grid (row blocks, N / BN, K splits); or with ``t.weights_first``, where
    it applies, ``nvfp4_moe_prefill``'s kernel over the same row blocks."""
    k_split = k // split
    bk = _block_k(k_split, t.bk)
    weights_first = t.weights_first and mode in WEIGHTS_FIRST_MODES and k % bk == 0
    if weights_first and split == 1 and not (dense_m or act_splits):
        return prefill.launch(a, w, s, decode, out, routing, topw, n, k, top_k, epilogue, mode, t.bn, bk,
                              t.warps, t.stages, INTERPRET)  # fmt: skip
    if split > 1 and k_split % bk:
        raise ValueError(f"K = {k} does not split into {split} ranges of whole {bk}-wide tiles")
    if dense_m:
        bm = 16 if dense_m <= 16 else 64
        grid_m, tables = triton.cdiv(dense_m, bm), (decode,) * 5
    else:
        bm = routing.bm
        grid_m = routing.blk_expert.numel()
        tables = (routing.order, routing.blk_expert, routing.blk_start, routing.blk_count, routing.nblk)
    stride_os = out.stride(0) if out.ndim == 3 else 0
    _w4a16_kernel[(grid_m, triton.cdiv(n, t.bn), split)](
        a, *a_strides, w, s, decode, out, out.stride(-2), stride_os, *tables, topw,
        dense_m, n, k, k_split, top_k,
        w.stride(0) if w.ndim == 3 else 0, w.stride(-2), s.stride(0) if s.ndim == 3 else 0, stride_sn,
        decode.stride(0) if decode.ndim else 0,
        DENSE=bool(dense_m), MODE=mode, EPILOGUE=epilogue, ACT_SPLITS=act_splits, BM=bm, BN=t.bn, BK=bk,
        EVEN_K=k_split % bk == 0, DOT_F32=INTERPRET, num_warps=t.warps, num_stages=t.stages, **pdl_args(),
    )  # fmt: skip
    return out


def moe_gate_up(
    x, packed, scales, decode, routing: Routing, top_k: int, out=None, tiles: Tiles | None = None
):
    """x [T, H] bf16; packed [E, 2I, H/2] (or bf16 [E, 2I, H], scales unused) -> silu(gate) * up per pair
    [T*k, I] bf16 (rows = pair index), or with ``tiles.split`` = s >= 1 the gate/up partial sums
    [s, T*k, 2I] fp32 that ``moe_down`` finishes."""
    two_i, hidden = packed.shape[1], x.shape[1]
    t = tiles or plan(routing.bm, x.shape[0], _mode(packed))[0]
    tk = x.shape[0] * top_k
    s = uint8_view(scales)
    if t.split:
        if out is None:
            out = torch.empty(t.split, tk, two_i, dtype=torch.float32, device=x.device)
        n, epilogue = two_i, PARTIAL
    else:
        if out is None:
            out = torch.empty(tk, two_i // 2, dtype=x.dtype, device=x.device)
        n, epilogue = two_i // 2, GATED
    return _launch(
        x, (x.stride(0), 0), 0, packed, s, s.stride(1), decode, out, routing, decode, n, hidden, top_k,
        epilogue, _mode(packed), t, max(1, t.split),
    )  # fmt: skip


def moe_down(
    act, packed, scales, decode, routing: Routing, topk_weights, out=None, tiles: Tiles | None = None
):
    """act [T*k, I] bf16 (pair rows), or gate/up partial sums [s, T*k, 2I] fp32; packed [E, H, I/2] ->
    weight * down(silu(gate) * up) per pair [T*k, H] bf16. The kernel rounds each pair's weighted output to
    bf16 (as the CPU path does before its sum), so a bf16 buffer holds it exactly: half the bytes of fp32
    for the sum over each token's pairs that follows (an 8K prefill wrote and read 0.5 GB per layer)."""
    hidden = packed.shape[1]
    splits = act.shape[0] if act.ndim == 3 else 0
    pairs = act.shape[-2]
    inter = act.shape[-1] // 2 if splits else act.shape[-1]
    t = tiles or plan(routing.bm, pairs // max(1, topk_weights.shape[-1]), _mode(packed))[1]
    if out is None:
        out = torch.empty(pairs, hidden, dtype=torch.bfloat16, device=act.device)
    s = uint8_view(scales)
    a_strides = (act.stride(1), act.stride(0)) if splits else (act.stride(0), 0)
    return _launch(
        act, a_strides, splits, packed, s, s.stride(1), decode, out, routing, topk_weights.reshape(-1),
        hidden, inter, 1, WEIGHTED, _mode(packed), t,
    )  # fmt: skip


def nvfp4_linear(x, packed, scales, decode, out=None):
    """Dense NVFP4 linear: x [M, K] bf16, packed [N, K/2], scales [N, K/16], decode 0-D -> [M, N] bf16."""
    s = uint8_view(scales)
    return _dense(x, packed, s, s.stride(0), decode.reshape(1), DEQUANT_MODE, out)


def fp8_linear(x, weight, scale, out=None):
    """Per-tensor FP8 linear, weight-only: x [M, K] bf16, weight e4m3 [N, K], scale fp32 0-D -> [M, N] bf16
    (the engine's FP8 groups; vLLM runs these W8A8)."""
    w = uint8_view(weight)
    return _dense(x, w, w, 0, scale.reshape(1).float(), 3, out)


def bf16_linear(x, weight, out=None):
    """x [M, K] @ weight [N, K]^T for a few bf16 rows (M <= 16), through the same kernel: cuBLAS picks a
    slow kernel for some thin shapes (H200, the fused router + shared-expert GEMM, N = 1281, K = 2048: 23.3 us
    at M = 3 against 4.5 us at M = 1; this kernel: 6.6 us; benchmarks/tune_dense.py)."""
    t = Tiles(16 if weight.shape[0] < 4096 else 32, 128, 4, 5)
    return _dense(x, weight, weight, 0, _unit_scale(x.device), 0, out, t)


_UNIT_SCALES: dict[torch.device, torch.Tensor] = {}


def _unit_scale(device: torch.device) -> torch.Tensor:
    """A decode scale of 1 per device, made once (not a fill kernel per call in a captured step; the
    first call runs in the warm-up before capture)."""
    if device not in _UNIT_SCALES:
        _not_capturing(device, "the unit decode scale")
        _UNIT_SCALES[device] = torch.ones(1, device=device)
    return _UNIT_SCALES[device]


def _not_capturing(device: torch.device, what: str) -> None:
    """Module-level constants must be made outside a CUDA graph capture: made inside, they would live in
    the graph's private pool and only be filled when that graph replays."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"{what} first made during a CUDA graph capture; run the step once before capturing"
        )


def _dense(x, w, s, stride_sn, d, mode: int, out, t: Tiles | None = None):
    """One weight matrix over every row of x (the kernel's DENSE branch)."""
    m, k = x.shape
    n = w.shape[0]
    t = t or (Tiles(32, 128, 4, 4) if m <= 16 else Tiles(64, 128, 4, 3))
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    return _launch(x, (x.stride(0), 0), 0, w, s, stride_sn, d, out, None, d, n, k, 1, 0, mode, t, dense_m=m)


# ---- references ---------------------------------------------------------------------------------------


def linear_reference(x, packed, scales, decode):
    return torch.nn.functional.linear(x, nvfp4.dequantize_modelopt(packed, scales, decode, x.dtype))


def fp8_linear_reference(x, weight, scale):
    return torch.nn.functional.linear(x, (weight.double() * scale.double()).to(x.dtype))


def moe_reference(x, gu_packed, gu_scales, gu_decode, d_packed, d_scales, d_decode, topk_ids, topk_weights):
    """sum_k w * down(silu(gate x) * up x) per token, experts dequantized by formats.nvfp4 [T, H] fp32."""
    inter = gu_packed.shape[1] // 2
    out = torch.zeros(x.shape[0], d_packed.shape[1], dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            gate = nvfp4.dequantize_modelopt(
                gu_packed[e, :inter], gu_scales[e, :inter], gu_decode[e, 0], x.dtype
            )
            up = nvfp4.dequantize_modelopt(
                gu_packed[e, inter:], gu_scales[e, inter:], gu_decode[e, 1], x.dtype
            )
            down = nvfp4.dequantize_modelopt(d_packed[e], d_scales[e], d_decode[e], x.dtype)
            h = torch.nn.functional.silu(x[t] @ gate.T) * (x[t] @ up.T)
            out[t] += (h @ down.T).float() * topk_weights[t, j].float()
    return out


def moe_experts(experts, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """``layers.moe.RoutedExperts`` on the GPU: sum_k w * down(silu(gate x) * up x) [T, H] in fp32."""
    t, k = topk_ids.shape
    return moe_pairs(experts, x, topk_ids, topk_weights).view(t, k, -1).sum(1, dtype=torch.float32)


GEMV_MAX_TOKENS = 4  # up to this many tokens, every (token, expert) pair runs as GEMVs (nvfp4_gemv)
# from GEMV_MAX_TOKENS + 1 up to this many tokens, NVFP4 experts run as tensor-core GEMVs in blocks of up to 8
# tokens of an expert (nvfp4_mma_gemv; sm89+, not under the interpreter). H200, full-size experts per layer
# (benchmarks/tune_experts.py): 50 + 29 us at 16 tokens against the grouped GEMM's 81 + 43, 101 + 58 at 64
# against 156 + 87; at 1 token 7.9 + 4.4 against the CUDA-core GEMV's 7.7 + 5.1, and in the captured step
# 0-4% slower than the GEMV, so those keep the one-token kernels. 0 turns every tensor-core GEMV off.
MMA_GEMV_MAX_TOKENS = int(os.environ.get("FP4MOE_MMA_GEMV_MAX_TOKENS", "128"))


# up to GEMV_MAX_TOKENS tokens: the CUDA-core gate/up GEMV, then the tensor-core down (pairs, wk 2, kc 64): H200,
# batch-1 step 1.4% faster (benchmarks/tune_decode.py; the down launch alone 4.4 against 5.1 us per layer). Needs
# int32 contiguous ids (the router kernel's): its programs read them before they wait, so no copy may be in flight
ONE_TOKEN_MMA_DOWN = True


@functools.cache
def _have_gluon() -> bool:
    """Whether this Triton has the Gluon API the tensor-core GEMVs use (3.6: linear layouts, trivial-conversion
    checks; ``pip install '.[gpu]'`` allows older Tritons, which then keep the Triton kernels)."""
    import triton

    if tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 6):
        return False
    try:
        from fp4moe.kernels import nvfp4_mma_gemv  # noqa: F401
    except (ImportError, AttributeError):
        return False
    return True


def _mma_gemv_fits(experts, x: torch.Tensor, one_token: bool = False) -> bool:
    if not (
        experts.quantized
        and not INTERPRET
        and x.is_cuda
        and DEQUANT_MODE == 7
        and MMA_GEMV_MAX_TOKENS > 0
        and (one_token or GEMV_MAX_TOKENS < x.shape[0] <= MMA_GEMV_MAX_TOKENS)
        and torch.cuda.get_device_capability(x.device) >= (8, 9)  # (fp8 scale conversion: sm89+)
        and _have_gluon()
    ):
        return False
    from fp4moe.kernels import nvfp4_mma_gemv as mma

    return mma.fits(x.shape[1], experts.inter)


def moe_pairs(experts, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """Each (token, expert) pair's weighted output [T*k, H] bf16 (pair = token * k + j)."""
    t, k = topk_ids.shape
    if experts.quantized:
        gu = (experts.gate_up_packed, experts.gate_up_scales, experts.gate_up_decode)
        dn = (experts.down_packed, experts.down_scales, experts.down_decode)
    else:
        ones = experts.unit_scales()
        gu = (experts.gate_up_proj, experts.gate_up_proj, ones[0])
        dn = (experts.down_proj, experts.down_proj, ones[1])
    if _mma_gemv_fits(experts, x):
        from fp4moe.kernels import nvfp4_mma_gemv as mma

        routing = align(topk_ids, experts.num_experts, mma.TOKENS)
        act = mma.mma_gate_up(x, *gu, routing, k)
        return mma.mma_down(act, *dn, routing, topk_weights)
    if t <= GEMV_MAX_TOKENS and x.shape[1] % 32 == 0 and experts.inter % 32 == 0:
        from fp4moe.kernels import nvfp4_gemv as gemv

        one_token_mma = (
            ONE_TOKEN_MMA_DOWN
            and topk_ids.dtype == torch.int32
            and topk_ids.is_contiguous()
            and topk_weights.dtype == torch.float32
            and _mma_gemv_fits(experts, x, one_token=True)
        )
        pairs = pair_routing(topk_ids, 1) if one_token_mma else None  # (a view of the ids: no copy)
        act = gemv.gemv_gate_up(x, *gu, topk_ids)
        if one_token_mma:
            from fp4moe.kernels import nvfp4_mma_gemv as mma

            return mma.mma_down(act, *dn, pairs, topk_weights, tiles=mma.ONE_TOKEN_DOWN_TILES)
        return gemv.gemv_down(act, *dn, topk_ids, topk_weights)
    # 128-row blocks only where the weights-first kernel takes both launches (K a multiple of its tile)
    weights_first = _mode(gu[0]) in WEIGHTS_FIRST_MODES and x.shape[1] % 32 == 0 and experts.inter % 32 == 0
    bm = block_m(t, k, experts.num_experts, weights_first)
    if t <= PAIR_ROUTING_MAX_TOKENS and bm == 16:
        routing = pair_routing(topk_ids, bm)
    else:
        routing = align(topk_ids, experts.num_experts, bm)
    act = moe_gate_up(x, *gu, routing, k)
    return moe_down(act, *dn, routing, topk_weights.float())
