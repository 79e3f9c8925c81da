"""NVFP4 weight-only expert GEMVs for decode: one (token, expert) pair per program row, no tensor cores.

At a few tokens per step every (token, expert) pair is its own one-row product. The grouped GEMM
(``nvfp4_gemm``) runs those on the tensor cores in 16-row tiles (15 rows of zeros) and passes each
dequantized tile through shared memory into the MMA; here a program dequantizes a [BN, BK] weight tile in
registers exactly as the GEMM does (same modes, same values: ``nvfp4_dequant``), multiplies it by the
pair's activation row on the CUDA cores and keeps [BN, BK] fp32 partial sums, reduced once after the K
loop. Nothing is sorted: the program's expert is the router's own output (``topk_ids``).

Gate/up programs compute gate rows n and up rows I + n of the pair's expert and store silu(gate) * up
(rounded where the CPU path rounds); down programs multiply by the pair's routing weight and store each
pair's weighted output in bf16 (exact: the value is rounded to bf16 first, as in the GEMM). References: the
GEMM's ``moe_reference``; tests compare both kernels with it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4moe.kernels import pdl_args, uint8_view, unit_scale
from fp4moe.kernels.expert_layout import expert_ptrs
from fp4moe.kernels.nvfp4_dequant import (
    block_k,
    dequant_asm_of,
    dequant_bf16_bits_of,
    dequant_bf16_of,
    mode_of,
)
from fp4moe.kernels.tl_helpers import round_bf16, wait_for_previous


@triton.jit
def _tile_ptrs(w_e, s_e, rows, k0, stride_wn, stride_sn, half, MODE: tl.constexpr, BK: tl.constexpr,
               GATED: tl.constexpr, TILE: tl.constexpr):  # fmt: skip
    """Pointers to one K tile of rows ``rows`` of the weights at ``w_e`` / ``s_e``: weights [BN, BK] (bf16) or
    codes [BN, BK/2], and scale bytes [BN, BK/16], in the experts' byte order (``expert_layout``; TILE 0:
    row-major)."""
    w_ptrs, s_ptrs = expert_ptrs(w_e, s_e, rows, k0, stride_wn, stride_sn, half, BK, GATED, TILE)
    if MODE == 0:
        w_ptrs = w_e + rows[:, None] * stride_wn + (k0 + tl.arange(0, BK))[None, :]
    return w_ptrs, s_ptrs


@triton.jit
def _load_tile(w_ptrs, s_ptrs, mask_n, MODE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """One K tile as stored: (bf16 weights [BN, BK], unused zeros) or (codes [BN, BK/2], scale bytes
    [BN, BK/16]); rows past N read as zeros."""
    if MODE == 0:
        w = tl.load(w_ptrs, mask=mask_n[:, None] & (tl.arange(0, BK) >= 0)[None, :], other=0.0)
        s = tl.zeros((BN, BK // 16), dtype=tl.uint8)
    else:
        w = tl.load(w_ptrs, mask=mask_n[:, None] & (tl.arange(0, BK // 2) >= 0)[None, :], other=0)
        s = tl.load(s_ptrs, mask=mask_n[:, None] & (tl.arange(0, BK // 16) >= 0)[None, :], other=0)
    return w, s


@triton.jit
def _partial(acc, a_row, k0, w, s, MODE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
             SUM_EACH: tl.constexpr):  # fmt: skip
    """acc += one K tile (``_load_tile``) of W[n, k] * a[k]: elementwise into acc [BN, BK] (or [BN, BK/2]
    in mode 7), or (SUM_EACH) summed along K into acc [BN, 1]."""
    if MODE == 7:  # even and odd k as two half tiles, as the GEMM's mode 7
        offs_kh = tl.arange(0, BK // 2)
        lo, hi = dequant_asm_of(w, s, BN, BK)
        a_even = tl.load(a_row + k0 + 2 * offs_kh).to(tl.float32)
        a_odd = tl.load(a_row + k0 + 2 * offs_kh + 1).to(tl.float32)
        prod = lo.to(tl.float32) * a_even[None, :] + hi.to(tl.float32) * a_odd[None, :]
    else:
        if MODE == 4:
            w = dequant_bf16_bits_of(w, s, BN, BK)
        elif MODE != 0:
            w = dequant_bf16_of(w, s, BN, BK)
        prod = w.to(tl.float32) * tl.load(a_row + k0 + tl.arange(0, BK)).to(tl.float32)[None, :]
    # (one return statement: the compiler wants every return of one type)
    acc = acc + tl.sum(prod, 1, keep_dims=True) if SUM_EACH else acc + prod
    return acc


@triton.jit
def _gemv_kernel(
    a_ptr,
    stride_am,
    w_ptr,
    s_ptr,
    d_ptr,
    out_ptr,
    stride_om,
    ids_ptr,
    topw_ptr,
    N,
    K,
    TOPK,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_de,
    GATED: tl.constexpr,
    DENSE: tl.constexpr,
    MODE: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    SUM_EACH: tl.constexpr,
    PDL: tl.constexpr,
    TILE: tl.constexpr = 0,
):
    """Program (pair p, output block): GATED: silu(gate) * up of rows n < N (gate) and N + n (up) of
    x[p // TOPK]; else the down product of act[p] times the pair's routing weight. K % BK == 0. SUM_EACH:
    reduce each K tile's products at once (fewer registers: room for a K tile as long as K).

    Dense and down programs load their first weight tile before they wait for the kernel ahead: the weights
    (and a down pair's expert, chosen by the router two kernels back) do not depend on it. Behind a kernel
    that lets its dependents start early (``pdl_args``: the norms ahead of dense projections, the gate/up
    launch ahead of down) that load overlaps it; under plain PDL it costs nothing."""
    PRELOAD: tl.constexpr = not GATED
    p = tl.program_id(0)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    mask_n = offs_n < N
    if PRELOAD:
        # DENSE: one weight matrix, row p of a, no routing weight. The pair's expert was written by the
        # router, which finished before the gate/up launch ahead let this one start (L2, not L1: ".cg")
        e = p.to(tl.int64) * 0 if DENSE else tl.load(ids_ptr + p, cache_modifier=".cg").to(tl.int64)
        w_e = w_ptr + e * stride_we
        s_e = s_ptr + e * stride_se
        w_ptrs, s_ptrs = _tile_ptrs(w_e, s_e, offs_n, 0, stride_wn, stride_sn, N, MODE, BK, GATED, TILE)
        w_first, s_first = _load_tile(w_ptrs, s_ptrs, mask_n, MODE, BN, BK)
    wait_for_previous(PDL)
    if not PRELOAD:
        e = tl.load(ids_ptr + p).to(tl.int64)
        w_e = w_ptr + e * stride_we
        s_e = s_ptr + e * stride_se
    a_row = a_ptr + (p // TOPK).to(tl.int64) * stride_am
    ACC_K: tl.constexpr = 1 if SUM_EACH else BK // 2 if MODE == 7 else BK
    acc = tl.zeros((BN, ACC_K), dtype=tl.float32)
    acc_up = tl.zeros((BN, ACC_K), dtype=tl.float32)
    if PRELOAD:
        acc = _partial(acc, a_row, 0, w_first, s_first, MODE, BN, BK, SUM_EACH)
    for k0 in range(BK if PRELOAD else 0, K, BK):
        w_ptrs, s_ptrs = _tile_ptrs(w_e, s_e, offs_n, k0, stride_wn, stride_sn, N, MODE, BK, GATED, TILE)
        w, s = _load_tile(w_ptrs, s_ptrs, mask_n, MODE, BN, BK)
        acc = _partial(acc, a_row, k0, w, s, MODE, BN, BK, SUM_EACH)
        if GATED:
            w_ptrs, s_ptrs = _tile_ptrs(
                w_e, s_e, offs_n + N, k0, stride_wn, stride_sn, N, MODE, BK, GATED, TILE
            )  # fmt: skip
            w, s = _load_tile(w_ptrs, s_ptrs, mask_n, MODE, BN, BK)
            acc_up = _partial(acc_up, a_row, k0, w, s, MODE, BN, BK, SUM_EACH)
    y = tl.sum(acc, 1)
    if MODE >= 4:  # the bf16-bit dequantization leaves a factor 2^-8 in the weights
        y = y * 256.0
    out_ptrs = out_ptr + p.to(tl.int64) * stride_om + offs_n
    if GATED:  # the CPU path rounds gate, up and silu(gate) to bf16 on the way; so do we
        up = tl.sum(acc_up, 1)
        if MODE >= 4:
            up = up * 256.0
        gate = round_bf16(y * tl.load(d_ptr + e * stride_de))
        up = round_bf16(up * tl.load(d_ptr + e * stride_de + 1))
        act = round_bf16(gate * tl.sigmoid(gate))
        tl.store(out_ptrs, round_bf16(act * up).to(out_ptr.dtype.element_ty), mask=mask_n)
    elif DENSE:
        tl.store(out_ptrs, round_bf16(y * tl.load(d_ptr)).to(out_ptr.dtype.element_ty), mask=mask_n)
    else:
        y = round_bf16(y * tl.load(d_ptr + e * stride_de)) * round_bf16(tl.load(topw_ptr + p).to(tl.float32))
        tl.store(out_ptrs, round_bf16(y).to(out_ptr.dtype.element_ty), mask=mask_n)


class GemvTiles:
    """Launch settings of one expert GEMV: output rows per program BN, K tile BK, warps, stages, and
    whether each K tile is reduced at once (``sum_each``) or kept elementwise until the end."""

    def __init__(self, bn: int, bk: int, warps: int, stages: int, sum_each: bool = False):
        self.bn, self.bk, self.warps, self.stages, self.sum_each = bn, bk, warps, stages, sum_each

    def __repr__(self) -> str:
        return (
            f"GemvTiles(bn={self.bn}, bk={self.bk}, warps={self.warps}, stages={self.stages}, "
            f"sum_each={self.sum_each})"
        )


# H200, benchmarks/tune/tune_experts.py --kernels gemv (40 layers' launches in a graph, full-size shapes): gate/up
# 7.6 / 17.2 us per layer at 1 / 3 tokens, down 5.1 / 11.3 (the grouped GEMM: 13.7 + 6.3 at one token)
GATE_UP_TILES = GemvTiles(8, 512, 4, 3, sum_each=True)
DOWN_TILES = GemvTiles(8, 256, 2, 3)


def _tiles(default: GemvTiles, n: int, x: torch.Tensor) -> GemvTiles:
    """The launch's tiles when the caller gave none. On the CPU (Triton's interpreter, the tests) a program
    costs Python per operation whatever its size, so the output rows go in one block of up to 256 instead
    of the GPU's 8: a fifth of the runner tests' time went to these GEMVs' many small programs. Each output
    row is computed alone, over the same K tiles in the same order, so the values are the same."""
    if x.is_cuda:
        return default
    bn = min(256, triton.next_power_of_2(n))
    return GemvTiles(max(default.bn, bn), default.bk, default.warps, default.stages, default.sum_each)


def _launch(a, w, s, stride_sn, decode, out, ids, topw, n, k, top_k, gated: bool, mode: int, t: GemvTiles,
            rows: int = 0, trigger: str = "", tile: int = 0):  # fmt: skip
    """One ``_gemv_kernel`` launch: grid (pairs -- or ``rows`` of a dense product --, N / BN); ``trigger``:
    when the kernel behind it may start (``pdl_args``). A gate/up launch lets the down launch behind it
    start once the router's outputs are in (the down programs then load their experts' first tiles)."""
    bk = block_k(k, t.bk)
    if k % bk:
        raise ValueError(f"input dimension {k} is not a multiple of 32 (the GEMV has no ragged K tile)")
    dense = w.ndim == 2
    _gemv_kernel[(rows if dense else ids.numel(), triton.cdiv(n, t.bn))](
        a, a.stride(0), w, s, decode, out, out.stride(0), ids, topw, n, k, top_k,
        0 if dense else w.stride(0), w.stride(-2), s.stride(0) if s.ndim == 3 else 0, stride_sn,
        decode.stride(0) if decode.ndim else 0,
        GATED=gated, DENSE=dense, MODE=mode, BN=t.bn, BK=bk, SUM_EACH=t.sum_each, TILE=tile, num_warps=t.warps,
        num_stages=t.stages,
        **pdl_args("after_wait" if gated else trigger),
    )  # fmt: skip
    return out


def gemv_gate_up(
    x, packed, scales, decode, topk_ids, out=None, tiles: GemvTiles | None = None, tile: int = 0
):
    """x [T, H] bf16; packed [E, 2I, H/2] (or bf16 [E, 2I, H]); topk_ids [T, k] -> silu(gate) * up per pair
    [T*k, I] bf16 (row = pair index token * k + j). ``tile``: the experts' byte order (``expert_layout``)."""
    two_i, hidden = packed.shape[1], x.shape[1]
    mode = mode_of(packed)
    ids = topk_ids.reshape(-1)
    if out is None:
        out = torch.empty(ids.numel(), two_i // 2, dtype=x.dtype, device=x.device)
    s = uint8_view(scales)
    return _launch(
        x, packed, s, s.stride(1), decode, out, ids, decode, two_i // 2, hidden, topk_ids.shape[-1], True,
        mode, tiles or _tiles(GATE_UP_TILES, two_i // 2, x), tile=tile,
    )  # fmt: skip


def gemv_down(
    act,
    packed,
    scales,
    decode,
    topk_ids,
    topk_weights,
    out=None,
    tiles: GemvTiles | None = None,
    tile: int = 0,
):
    """act [T*k, I] bf16 (pair rows); packed [E, H, I/2] (or bf16 [E, H, I]) -> weight * down(act) per pair
    [T*k, H] bf16. ``topk_ids`` must be contiguous: the down programs read them before they wait for the
    kernel ahead (``_gemv_kernel``), so a copy launched just before them could still be in flight."""
    hidden, inter = packed.shape[1], act.shape[1]
    if not topk_ids.is_contiguous():
        raise ValueError("gemv_down needs contiguous topk_ids (read before the wait for the kernel ahead)")
    ids = topk_ids.view(-1)
    if out is None:
        out = torch.empty(ids.numel(), hidden, dtype=torch.bfloat16, device=act.device)
    s = uint8_view(scales)
    return _launch(
        act, packed, s, s.stride(1), decode, out, ids, topk_weights.reshape(-1).float(), hidden, inter, 1, False,
        mode_of(packed), tiles or _tiles(DOWN_TILES, hidden, act), tile=tile,
    )  # fmt: skip


def dense_tiles(n: int) -> GemvTiles:
    """H200, one row, benchmarks/tune/tune_dense.py --kernels gemv (cuBLAS in brackets): Gated DeltaNet in_proj
    12352 x 2048 13.4 us (15.5), attention qkv 9216 x 2048 10.7 (12.0), out_proj 2048 x 4096 6.6 (9.0: split-K
    and its reduce), router + shared gate/up 1281 x 2048 3.6 (4.6), shared down 2048 x 512 2.2 (3.8)."""
    return GemvTiles(16, 256, 4, 3) if n >= 8192 else GemvTiles(4, 1024, 8, 3, sum_each=True)


# 2-4 rows (a batch-1 speculative verification, batches of 2-4) of the narrower projections -- out_proj and
# o_proj 2048 x 4096, the MTP head's fc, shared down 2048 x 512: H200, 3 rows, benchmarks/tune/tune_dense.py --kernels
# gemv: 8.0 and 2.6 us against cuBLAS's 8.8 (split-K and its reduce) and 3.8. Wider ones read their weight
# once per row here (the in_proj's 12,352 x 2048: 20.8 us against 16.0) and stay with cuBLAS or the grouped
# kernel.
FEW_ROWS = 4
FEW_ROWS_MAX_N = 4096
FEW_ROWS_TILES = GemvTiles(8, 512, 4, 3)


def gemv_fits(x: torch.Tensor, weight: torch.Tensor, max_rows: int = 1) -> bool:
    """Whether bf16 rows on the GPU go through ``bf16_gemv``: one row, or up to ``max_rows`` of an output no
    wider than ``FEW_ROWS_MAX_N``; K a multiple of 32, rows of both with unit stride along K (the kernel
    reads them so), and a weight small enough that launch latency, not bandwidth, bounds cuBLAS (the 1 GB
    lm_head runs at the copy rate) and whose output blocks fit one grid axis."""
    rows = x.numel() // max(x.shape[-1], 1)
    return (
        x.is_cuda
        and weight.device == x.device
        and (rows == 1 or (rows <= max_rows and weight.shape[0] <= FEW_ROWS_MAX_N and x.is_contiguous()))
        and x.stride(-1) == 1
        and x.dtype == weight.dtype == torch.bfloat16
        and weight.ndim == 2
        and weight.stride(-1) == 1
        and weight.shape[-1] == x.shape[-1]
        and x.shape[-1] % 32 == 0
        and weight.numel() <= 1 << 26
        and weight.shape[0] <= 65535 * 4
    )


def bf16_gemv(
    x: torch.Tensor, weight: torch.Tensor, out=None, tiles: GemvTiles | None = None, trigger: str = ""
) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T for a few bf16 rows on the CUDA cores -> [M, N] bf16 (fp32 sums, rounded
    once). ``trigger`` "start": the kernel behind it may start at once and load what does not depend on
    this one (the Gated DeltaNet decode kernel's states)."""

    m, k = x.shape
    n = weight.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    one = unit_scale(x.device)
    default = dense_tiles(n) if m == 1 else FEW_ROWS_TILES
    return _launch(
        x, weight, weight, 0, one, out, one, one, n, k, 1, False, 0, tiles or _tiles(default, n, x), rows=m,
        trigger=trigger,
    )  # fmt: skip
