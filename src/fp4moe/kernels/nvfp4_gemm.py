"""NVFP4 weight-only (W4A16) GEMMs: the routed experts of an MoE layer, grouped by expert, and a dense
NVFP4 linear (one "expert", every row).

Weights stay packed ([E, N, K/2] uint8, two E2M1 codes per byte, even element in the low nibble),
with FP8-E4M3 block scales per 16 along K and one FP32 decode scale per projection. A program dequantizes
one [BN, BK] weight tile in registers, exactly (``nvfp4_dequant.DEQUANT_MODE`` 7, the GPU default: inline PTX writes two
codes' bits into bf16s per instruction, one bf16 multiply by the block scale, even and odd k as two half
tiles; mode 4: the same bits through Triton ops; mode 1, the interpreter's: code -> fp16 bits -> fp32, times
the block scale -> bf16), multiplies it with up to BM activation rows on the tensor cores, and applies the
decode scale once to the fp32 accumulator. BK divides K where a power of two >= 32 does, else the last K
tile is masked. Rows are (token, expert) pairs sorted by expert; a block table says which expert and which
run of sorted pairs each program row-block covers (``moe_routing``). Prefill-sized blocks (64 or 128 pairs) go to
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

import torch
import triton
import triton.language as tl

from fp4moe.formats import nvfp4
from fp4moe.kernels import INTERPRET, gpu_arch, pdl_args, uint8_view, unit_scale
from fp4moe.kernels import nvfp4_dequant as dq
from fp4moe.kernels import nvfp4_moe_prefill as prefill
from fp4moe.kernels.expert_layout import expert_ptrs
from fp4moe.kernels.moe_routing import Routing
from fp4moe.kernels.nvfp4_dequant import block_k, dequant_asm, dequant_bf16, dequant_bf16_bits, mode_of
from fp4moe.kernels.tl_helpers import e4m3_to_f16, round_bf16, wait_for_previous


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
        elif MODE == 3:  # per-tensor FP8-E4M3 weights (bytes): exact in bf16, the scale on the accumulator
            w = tl.load(w_ptrs, mask=mask_n[:, None] & k_ok[None, :], other=0)
            w = w.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
        elif MODE == 2:  # the same converted by bits (GPUs without e4m3 conversions, ``gpu_arch``)
            w = tl.load(w_ptrs, mask=mask_n[:, None] & k_ok[None, :], other=0)
            w = e4m3_to_f16(w).to(tl.bfloat16)
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
    TILE: tl.constexpr = 0,
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
    HALF = N // 2 if EPILOGUE == 3 else N  # gate/up: the first up row (split partials span both halves)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    acc_up = tl.zeros((BM, BN), dtype=tl.float32)
    a_base = a_ptr + rows[:, None].to(tl.int64) * stride_am
    k_lo = pid_s * K_SPLIT
    for k0 in range(k_lo, k_lo + K_SPLIT, BK):
        if MODE == 0 or MODE == 2 or MODE == 3:
            w_ptrs = w_base + offs_n[:, None] * stride_wn + (k0 + offs_k)[None, :]
            s_ptrs = w_ptrs
        else:  # the experts' byte order (``expert_layout``): gate/up rows N / 2 on are up rows when split
            w_ptrs, s_ptrs = expert_ptrs(
                w_base, s_base, offs_n, k0, stride_wn, stride_sn, HALF, BK, EPILOGUE % 2 == 1, TILE
            )  # fmt: skip
        a_mask = mask_m[:, None] & ((k0 + offs_k < K)[None, :] if not EVEN_K else (offs_k >= 0)[None, :])
        a = _load_a(a_base, (k0 + offs_k)[None, :], a_mask, K, stride_as, ACT_SPLITS)
        acc += _tile_dot(
            a, k0, K, w_ptrs, s_ptrs, mask_n, offs_k, offs_kh, offs_ks, MODE, BN, BK, EVEN_K, DOT_F32
        )
        if EPILOGUE == 1:
            if MODE == 0 or MODE == 2 or MODE == 3:
                w_up = w_ptrs + N * stride_wn
                s_up = w_up
            else:
                w_up, s_up = expert_ptrs(
                    w_base, s_base, offs_n + N, k0, stride_wn, stride_sn, N, BK, True, TILE
                )
            acc_up += _tile_dot(
                a, k0, K, w_up, s_up, mask_n, offs_k, offs_kh, offs_ks, MODE, BN, BK, EVEN_K, DOT_F32
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


# ---- launchers ----------------------------------------------------------------------------------------


GATED, WEIGHTED, PARTIAL = 1, 2, 3  # the kernel's EPILOGUE (0: dense)


def block_m(num_tokens: int, top_k: int, num_experts: int, weights_first: bool | None = None) -> int:
    """Rows per expert block: 16 (the smallest tensor-core tile) for decode, up to 64 for prefill; 128 where
    experts get at least 128 pairs each and the weights-first kernel runs (``plan``; ``weights_first`` None:
    whether ``DEQUANT_MODE`` has it)."""
    per_expert = num_tokens * top_k / num_experts
    if weights_first is None:
        weights_first = dq.DEQUANT_MODE in prefill.MODES
    if per_expert >= 128 and weights_first:
        return 128
    return 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64


class Tiles:
    """Launch settings of one expert GEMM: output tile width BN, K tile BK (a cap: the largest power of
    two dividing the K range), warps, pipeline stages, and the number of K splits (gate/up only: 0 fuses
    silu(gate) * up into the launch; s >= 1 writes fp32 partial sums of s K ranges, gate and up rows in
    separate programs, and the down launch computes the activation from them). ``weights_first``: the
    launch runs ``nvfp4_moe_prefill``'s kernel (weights as the MMA's first operand; no split, K a multiple
    of BK, dequantization mode 1 or 7), else it falls back to the row kernel with the same tiles; ``wide``
    (weights-first down only): two ``bn`` row tiles a program sharing each activation tile."""

    def __init__(
        self,
        bn: int,
        bk: int,
        warps: int,
        stages: int,
        split: int = 0,
        weights_first: bool = False,
        wide: bool = False,
    ):
        self.bn, self.bk, self.warps, self.stages, self.split = bn, bk, warps, stages, split
        self.weights_first, self.wide = weights_first, wide

    def __repr__(self) -> str:
        return (
            f"Tiles(bn={self.bn}, bk={self.bk}, warps={self.warps}, stages={self.stages}, split={self.split}, "
            f"weights_first={self.weights_first}{', wide=True' if self.wide else ''})"
        )


def plan(bm: int, tokens: int, mode: int | None = None) -> tuple[Tiles, Tiles]:
    """(gate/up, down) launch settings for a row block of ``bm`` and ``tokens`` tokens in the launch (H200
    sweep, benchmarks/tune/tune_experts.py: graph-replayed launches over 40 layers' experts; prefill blocks:
    benchmarks/tune/tune_prefill_experts.py), for dequantization ``mode`` (default ``DEQUANT_MODE``)."""
    if bm <= 16 and tokens <= 1:
        return Tiles(32, 256, 4, 3), Tiles(32, 128, 2, 3)
    if bm <= 16 and tokens <= 4:
        return Tiles(64, 256, 4, 3), Tiles(64, 128, 4, 2)
    if bm <= 16:
        return Tiles(64, 256, 4, 3), Tiles(64, 128, 4, 3)
    if bm >= 64 and (dq.DEQUANT_MODE if mode is None else mode) in prefill.MODES:
        # H200, 8,192 tokens (bm 128): gate/up 1.02 ms, down 0.78 ms per layer against the row kernel's best
        # 1.37 and 0.86; 2,048 tokens (bm 64): 0.45 and 0.27 against 0.47 and 0.28. Down with two row tiles
        # a program (wide, 2 stages): 0.668 ms at 8,192 tokens, 0.393 at 4,096 (0.785, 0.427 one-tile)
        down = (
            Tiles(64, 128, 4, 2, weights_first=True, wide=True)
            if bm >= 128
            else Tiles(64, 64, 4, 3, weights_first=True)
        )
        return Tiles(64, 128, 4, 2, weights_first=True), down
    if bm >= 64:  # prefill (8K tokens: down 1.02 ms per layer against 1.32 with the gate/up's tiles)
        return Tiles(64, 128, 4, 3), Tiles(128, 64, 4, 3)
    return Tiles(64, 128, 4, 3), Tiles(64, 128, 4, 3)


def stage_bytes(bm: int, bn: int, bk: int, mode: int, gated: bool) -> int:
    """Shared memory of one pipeline stage of ``_w4a16_kernel``: the bf16 activation tile and the weight
    tile(s) (gate and up with GATED) -- bf16, e4m3 bytes or NVFP4 codes and block scales by ``mode``."""
    weight = bk * 2 if mode == 0 else bk if mode in (2, 3) else bk // 2 + bk // 16
    return bm * bk * 2 + (2 if gated else 1) * bn * weight


def _launch(a, a_strides, act_splits, w, s, stride_sn, decode, out, routing, topw, n, k, top_k, epilogue,
            mode, t: Tiles, split: int = 1, dense_m: int = 0, tile: int = 0):  # fmt: skip
    """One ``_w4a16_kernel`` launch: grid (row blocks, N / BN, K splits); or with ``t.weights_first``, where
    it applies, ``nvfp4_moe_prefill``'s kernel over the same row blocks."""
    k_split = k // split
    bk = block_k(k_split, t.bk)
    weights_first = t.weights_first and mode in prefill.MODES and k % bk == 0
    if weights_first and split == 1 and not (dense_m or act_splits):
        return prefill.launch(a, w, s, decode, out, routing, topw, n, k, top_k, epilogue, mode, t.bn, bk,
                              t.warps, t.stages, INTERPRET, tile, t.wide)  # fmt: skip
    if tile and (mode in (0, 2, 3) or dense_m):
        raise ValueError("only NVFP4 expert weights come in tile order (expert_layout)")
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
    stages = gpu_arch.fit_stages(
        t.stages, stage_bytes(bm, t.bn, bk, mode, epilogue == GATED), gpu_arch.max_shared(a.device)
    )
    _w4a16_kernel[(grid_m, triton.cdiv(n, t.bn), split)](
        a, *a_strides, w, s, decode, out, out.stride(-2), stride_os, *tables, topw,
        dense_m, n, k, k_split, top_k,
        w.stride(0) if w.ndim == 3 else 0, w.stride(-2), s.stride(0) if s.ndim == 3 else 0, stride_sn,
        decode.stride(0) if decode.ndim else 0,
        DENSE=bool(dense_m), MODE=mode, EPILOGUE=epilogue, ACT_SPLITS=act_splits, BM=bm, BN=t.bn, BK=bk,
        EVEN_K=k_split % bk == 0, DOT_F32=INTERPRET, TILE=tile, num_warps=t.warps, num_stages=stages,
        **pdl_args(),
    )  # fmt: skip
    return out


def moe_gate_up(
    x,
    packed,
    scales,
    decode,
    routing: Routing,
    top_k: int,
    out=None,
    tiles: Tiles | None = None,
    tile: int = 0,
):
    """x [T, H] bf16; packed [E, 2I, H/2] (or bf16 [E, 2I, H], scales unused) -> silu(gate) * up per pair
    [T*k, I] bf16 (rows = pair index), or with ``tiles.split`` = s >= 1 the gate/up partial sums
    [s, T*k, 2I] fp32 that ``moe_down`` finishes. ``tile``: the experts' byte order (``expert_layout``)."""
    two_i, hidden = packed.shape[1], x.shape[1]
    t = tiles or plan(routing.bm, x.shape[0], mode_of(packed))[0]
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
        epilogue, mode_of(packed), t, max(1, t.split), tile=tile,
    )  # fmt: skip


def moe_down(
    act, packed, scales, decode, routing: Routing, topk_weights, out=None, tiles: Tiles | None = None,
    tile: int = 0,
):  # fmt: skip
    """act [T*k, I] bf16 (pair rows), or gate/up partial sums [s, T*k, 2I] fp32; packed [E, H, I/2] ->
    weight * down(silu(gate) * up) per pair [T*k, H] bf16. The kernel rounds each pair's weighted output to
    bf16 (as the CPU path does before its sum), so a bf16 buffer holds it exactly: half the bytes of fp32
    for the sum over each token's pairs that follows (an 8K prefill wrote and read 0.5 GB per layer)."""
    hidden = packed.shape[1]
    splits = act.shape[0] if act.ndim == 3 else 0
    pairs = act.shape[-2]
    inter = act.shape[-1] // 2 if splits else act.shape[-1]
    t = tiles or plan(routing.bm, pairs // max(1, topk_weights.shape[-1]), mode_of(packed))[1]
    if out is None:
        out = torch.empty(pairs, hidden, dtype=torch.bfloat16, device=act.device)
    s = uint8_view(scales)
    a_strides = (act.stride(1), act.stride(0)) if splits else (act.stride(0), 0)
    return _launch(
        act, a_strides, splits, packed, s, s.stride(1), decode, out, routing, topk_weights.reshape(-1),
        hidden, inter, 1, WEIGHTED, mode_of(packed), t, tile=tile,
    )  # fmt: skip


def nvfp4_linear(x, packed, scales, decode, out=None):
    """Dense NVFP4 linear: x [M, K] bf16, packed [N, K/2], scales [N, K/16], decode 0-D -> [M, N] bf16."""
    s = uint8_view(scales)
    return _dense(x, packed, s, s.stride(0), decode.reshape(1), mode_of(packed), out)


def fp8_linear(x, weight, scale, out=None):
    """Per-tensor FP8 linear, weight-only: x [M, K] bf16, weight e4m3 [N, K], scale fp32 0-D -> [M, N] bf16
    (the engine's FP8 groups; vLLM runs these W8A8)."""
    w = uint8_view(weight)
    return _dense(x, w, w, 0, scale.reshape(1).float(), 3 if gpu_arch.has_fp8(x.device) else 2, out)


def bf16_linear(x, weight, out=None):
    """x [M, K] @ weight [N, K]^T for a few bf16 rows (M <= 16), through the same kernel: cuBLAS picks a
    slow kernel for some thin shapes (H200, the fused router + shared-expert GEMM, N = 1281, K = 2048: 23.3 us
    at M = 3 against 4.5 us at M = 1; this kernel: 6.6 us; benchmarks/tune/tune_dense.py)."""
    t = Tiles(16 if weight.shape[0] < 4096 else 32, 128, 4, 5)
    return _dense(x, weight, weight, 0, unit_scale(x.device), 0, out, t)


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
