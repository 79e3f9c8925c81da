"""NVFP4 weight-only (W4A16) GEMMs: the routed experts of an MoE layer, grouped by expert, and a dense
NVFP4 linear (one "expert", every row).

Weights stay packed ([E, N, K/2] uint8, two E2M1 codes per byte, even element in the low nibble),
with FP8-E4M3 block scales per 16 along K and one FP32 decode scale per projection. A program dequantizes
one [BN, BK] weight tile in registers, exactly (``DEQUANT_MODE`` 4, the GPU default: each code's bits
written into a bf16 and one bf16 multiply by its block scale; mode 1, the interpreter's: code -> fp16 bits
-> fp32, times the block scale -> bf16; modes 2 and 5 split even and odd k, measured slower), multiplies it
with up to BM activation rows on the tensor cores, and applies the decode scale once to the fp32
accumulator. BK divides K where a power of two >= 32 does, else the last K tile is masked. Rows are
(token, expert) pairs sorted by expert; a block table says which expert and which run of sorted pairs
each program row-block covers (``align``).

Gate/up programs compute the gate rows n and the up rows I + n of one expert together and store
silu(gate) * up; down programs multiply by the pair's routing weight. References: ``moe_reference``,
``linear_reference`` (the engine's CPU path through ``formats.nvfp4``).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from fp4moe.formats import nvfp4
from fp4moe.kernels import INTERPRET, next_pow2, uint8_view
from fp4moe.kernels.tl_helpers import round_bf16


@triton.jit
def _dequant_bf16(w_ptrs, s_ptrs, w_mask, s_mask, BN: tl.constexpr, BK: tl.constexpr):
    """MODE 1: packed codes [BN, BK/2] and block scales [BN, BK/16] -> interleaved [BN, BK] bf16 tile
    (code -> fp16 bits with the exponent 14 too small -> fp32, times scale * 2^14 -> bf16, exact)."""
    packed = tl.load(w_ptrs, mask=w_mask, other=0).to(tl.uint16)
    codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), (BN, BK))  # even k from the low nibble
    bits = ((codes & 8) << 12) | ((codes & 7) << 9)
    vals = bits.to(tl.float16, bitcast=True).to(tl.float32)
    scales = tl.load(s_ptrs, mask=s_mask, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32) * 16384.0
    w = tl.reshape(vals, (BN, BK // 16, 16)) * scales[:, :, None]
    return tl.reshape(w, (BN, BK)).to(tl.bfloat16)


@triton.jit
def _dequant_half(codes, scales, BN: tl.constexpr, BK: tl.constexpr):
    """MODE 2: one parity's codes [BN, BK/2] (int32 nibbles) -> fp32 values * block scale, the E2M1 value
    written straight into fp32 bits (code m = 2..7: (m << 22) + 0x3F000000; m = 1: 0.5; m = 0: 0), so no
    conversion instruction runs per element; the tile feeds a tf32 dot, exact for these values."""
    mag = codes & 7
    bits = tl.where(mag >= 2, (mag << 22) + 0x3F000000, tl.where(mag == 1, 0x3F000000, 0)) | (
        (codes & 8) << 28
    )
    w = tl.reshape(bits.to(tl.float32, bitcast=True), (BN, BK // 16, 8)) * scales[:, :, None]
    return tl.reshape(w, (BN, BK // 2))


@triton.jit
def _bf16_codes(codes, s_ptrs, s_mask, BN: tl.constexpr, BK: tl.constexpr, PER: tl.constexpr):
    """MODES 4/5: codes [BN, BK*PER/16] (uint16 nibbles; PER consecutive codes share a block scale) ->
    bf16 value * block scale * 2^-8, exact, with no conversion instruction per element: the code's e1 e0 m
    bits go into the low exponent bits and the top mantissa bit of a bf16 (that is the E2M1 value times
    2^-126), and one bf16 multiply by scale * 2^118 (the 2^8 left over goes on the accumulator)."""
    vals = (((codes & 8) << 12) | ((codes & 7) << 6)).to(tl.bfloat16, bitcast=True)
    scales = tl.load(s_ptrs, mask=s_mask, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    scales = (scales * 3.3230699894622794e35).to(tl.bfloat16)  # * 2^118: exact
    w = tl.reshape(vals, (BN, BK // 16, PER)) * scales[:, :, None]
    return tl.reshape(w, (BN, BK // 16 * PER))


@triton.jit
def _dot(a, w, DOT_F32: tl.constexpr):
    """a [BM, K] @ w [BN, K]^T in fp32 (bf16 operands; fp32 ones under the interpreter)."""
    if DOT_F32:
        return tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)))
    return tl.dot(a.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)))


@triton.jit
def _tile_dot(a_base, a_mask, k0, K, w_ptrs, s_ptrs, mask_n, offs_k, offs_kh, offs_ks,
              MODE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
              DOT_F32: tl.constexpr):  # fmt: skip
    """One K tile's contribution a[:, k0:k0+BK] @ W[n, k0:k0+BK]^T -> [BM, BN] fp32 (masked along K
    unless EVEN_K: every load past K reads zeros, so a ragged last tile adds nothing)."""
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
    if MODE == 2:  # even and odd k apart: no interleaving of the weight tile
        packed = tl.load(w_ptrs, mask=w_mask, other=0).to(tl.int32)
        scales = tl.load(s_ptrs, mask=s_mask, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        a_half = a_mask & kh_ok[None, :]
        a_even = tl.load(a_base + (k0 + 2 * offs_kh)[None, :], mask=a_half, other=0.0).to(tl.float32)
        a_odd = tl.load(a_base + (k0 + 2 * offs_kh + 1)[None, :], mask=a_half, other=0.0).to(tl.float32)
        w_even = _dequant_half(packed & 0xF, scales, BN, BK)
        w_odd = _dequant_half((packed >> 4) & 0xF, scales, BN, BK)
        return tl.dot(a_even, tl.trans(w_even)) + tl.dot(a_odd, tl.trans(w_odd))
    if MODE == 5:  # even and odd k apart in bf16: no interleaving, bf16 dots
        packed = tl.load(w_ptrs, mask=w_mask, other=0).to(tl.uint16)
        a_half = a_mask & kh_ok[None, :]
        a_even = tl.load(a_base + (k0 + 2 * offs_kh)[None, :], mask=a_half, other=0.0)
        a_odd = tl.load(a_base + (k0 + 2 * offs_kh + 1)[None, :], mask=a_half, other=0.0)
        w_even = _bf16_codes(packed & 0xF, s_ptrs, s_mask, BN, BK, 8)
        w_odd = _bf16_codes(packed >> 4, s_ptrs, s_mask, BN, BK, 8)
        return _dot(a_even, w_even, DOT_F32) + _dot(a_odd, w_odd, DOT_F32)
    a = tl.load(a_base + (k0 + offs_k)[None, :], mask=a_mask & k_ok[None, :], other=0.0)
    if MODE == 0:  # bf16 weights (the all-bf16 model through the same kernel)
        w = tl.load(w_ptrs, mask=mask_n[:, None] & k_ok[None, :], other=0.0)
    elif MODE == 3:  # per-tensor FP8-E4M3 weights (bytes): exact in bf16, the scale goes on the accumulator
        w = tl.load(w_ptrs, mask=mask_n[:, None] & k_ok[None, :], other=0)
        w = w.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
    elif MODE == 4:
        packed = tl.load(w_ptrs, mask=w_mask, other=0).to(tl.uint16)
        codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), (BN, BK))  # even k from the low nibble
        w = _bf16_codes(codes, s_ptrs, s_mask, BN, BK, 16)
    else:
        w = _dequant_bf16(w_ptrs, s_ptrs, w_mask, s_mask, BN, BK)
    return _dot(a, w, DOT_F32)


@triton.jit
def _w4a16_kernel(
    a_ptr,
    stride_am,
    w_ptr,
    s_ptr,
    d_ptr,
    out_ptr,
    stride_om,
    order_ptr,
    blk_expert_ptr,
    blk_start_ptr,
    blk_count_ptr,
    nblk_ptr,
    topw_ptr,
    M,
    N,
    K,
    TOPK,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_de,
    DENSE: tl.constexpr,
    MODE: tl.constexpr,
    GATED: tl.constexpr,
    WEIGHTED: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
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
        rows = pairs // TOPK if GATED else pairs
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
    a_mask = mask_m[:, None]
    for k0 in range(0, K, BK):
        if MODE == 0 or MODE == 3:
            w_ptrs = w_base + offs_n[:, None] * stride_wn + (k0 + offs_k)[None, :]
            s_ptrs = w_ptrs
        else:
            w_ptrs = w_base + offs_n[:, None] * stride_wn + (k0 // 2 + offs_kh)[None, :]
            s_ptrs = s_base + offs_n[:, None] * stride_sn + (k0 // 16 + offs_ks)[None, :]
        acc += _tile_dot(a_base, a_mask, k0, K, w_ptrs, s_ptrs, mask_n, offs_k, offs_kh, offs_ks,
                         MODE, BN, BK, EVEN_K, DOT_F32)  # fmt: skip
        if GATED:
            acc_up += _tile_dot(
                a_base, a_mask, k0, K, w_ptrs + N * stride_wn, s_ptrs + N * stride_sn, mask_n, offs_k, offs_kh,
                offs_ks, MODE, BN, BK, EVEN_K, DOT_F32,
            )  # fmt: skip
    if MODE >= 4:  # the bf16-bit dequantization leaves a factor 2^-8 in the weights
        acc = acc * 256.0
        acc_up = acc_up * 256.0
    if GATED:  # the CPU path rounds gate, up and silu(gate) to bf16 on the way; so do we
        gate = round_bf16(acc * tl.load(d_ptr + e * stride_de))
        up = round_bf16(acc_up * tl.load(d_ptr + e * stride_de + 1))
        act = round_bf16(gate * tl.sigmoid(gate))
        y = act * up
    else:
        y = acc * tl.load(d_ptr + e * stride_de)
        if WEIGHTED:
            topw = round_bf16(tl.load(topw_ptr + pairs, mask=mask_m, other=0.0))
            y = round_bf16(y) * topw[:, None]
    out_ptrs = out_ptr + pairs[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, round_bf16(y).to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


# ---- routing: (token, expert) pairs sorted by expert, and the block table --------------------------------


@triton.jit
def _align_kernel(
    ids_ptr,
    TK,
    order_ptr,
    blk_expert_ptr,
    blk_start_ptr,
    blk_count_ptr,
    nblk_ptr,
    MAXB,
    E: tl.constexpr,
    BM: tl.constexpr,
    CH: tl.constexpr,
):
    """One program: stable counting sort of the pairs by expert, then the block table."""
    experts = tl.arange(0, E)
    counts = tl.zeros((E,), dtype=tl.int32)
    for c0 in range(0, TK, CH):
        offs = c0 + tl.arange(0, CH)
        ids = tl.load(ids_ptr + offs, mask=offs < TK, other=-1)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), 0)
    starts = tl.cumsum(counts, 0) - counts
    running = tl.zeros((E,), dtype=tl.int32)
    for c0 in range(0, TK, CH):
        offs = c0 + tl.arange(0, CH)
        ids = tl.load(ids_ptr + offs, mask=offs < TK, other=-1)
        onehot = (ids[:, None] == experts[None, :]).to(tl.int32)
        within = tl.cumsum(onehot, 0) - onehot
        pos = tl.sum(onehot * (within + (starts + running)[None, :]), 1)
        tl.store(order_ptr + pos, offs, mask=offs < TK)
        running += tl.sum(onehot, 0)
    nb = (counts + BM - 1) // BM
    bstart = tl.cumsum(nb, 0) - nb
    total = tl.sum(nb, 0)
    tl.store(nblk_ptr, total)
    for b0 in range(0, MAXB, CH):
        b = b0 + tl.arange(0, CH)
        inside = (b[:, None] >= bstart[None, :]) & (b[:, None] < (bstart + nb)[None, :])
        e = tl.sum(tl.where(inside, experts[None, :], 0), 1)
        j = b - tl.sum(tl.where(inside, bstart[None, :], 0), 1)
        start = tl.sum(tl.where(inside, starts[None, :], 0), 1) + j * BM
        cnt = tl.minimum(tl.sum(tl.where(inside, counts[None, :], 0), 1) - j * BM, BM)
        valid = b < total
        tl.store(blk_expert_ptr + b, tl.where(valid, e, 0), mask=b < MAXB)
        tl.store(blk_start_ptr + b, tl.where(valid, start, 0), mask=b < MAXB)
        tl.store(blk_count_ptr + b, tl.where(valid, cnt, 0), mask=b < MAXB)


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


def align(
    topk_ids: torch.Tensor, num_experts: int, bm: int, ch: int | None = None, num_warps: int | None = None
) -> Routing:
    """topk_ids [T, k] -> Routing. One program for small batches (decode); torch sorting otherwise."""
    tk = topk_ids.numel()
    maxb = max_blocks(tk, num_experts, bm)
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int32)
    ch = ch or (8 if tk <= 128 else 64)  # H200 sweep (benchmarks/tune_kernels.py)
    num_warps = num_warps or (8 if tk <= 8 else 4)
    if tk <= 4096:
        order = torch.empty(tk, dtype=torch.int32, device=dev)
        blk = torch.empty(3, maxb, dtype=torch.int32, device=dev)
        nblk = torch.empty(1, dtype=torch.int32, device=dev)
        _align_kernel[(1,)](
            flat,
            tk,
            order,
            blk[0],
            blk[1],
            blk[2],
            nblk,
            maxb,
            E=next_pow2(num_experts),
            BM=bm,
            CH=ch,
            num_warps=num_warps,
        )
        return Routing(order, blk[0], blk[1], blk[2], nblk, bm)
    return align_reference(topk_ids, num_experts, bm)


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
    cnt = torch.where(valid, torch.minimum(counts[e] - j * bm, torch.tensor(bm, device=dev)), 0)
    return Routing(
        order,
        torch.where(valid, e, 0).to(torch.int32),
        start.to(torch.int32),
        cnt.to(torch.int32),
        total.reshape(1).to(torch.int32),
        bm,
    )


# ---- launchers ----------------------------------------------------------------------------------------


# 1: interleaved bf16 tiles through fp16 bits and fp32; 2: even/odd fp32 tiles, tf32 dot (slower on the H200:
# BENCHMARKS.md); 4: interleaved, codes straight into bf16 bits, one bf16 multiply; 5: as 4, even/odd
# halves with bf16 dots (no interleaving)
# the default: 4 on the GPU (H200, full-size decode at batch 1/16/64: 273/1476/3237 tok/s vs mode 1's
# 274/1440/3051, mode 5's 249/1386/3088); 1 under Triton's interpreter, whose bf16 arithmetic is not IEEE
DEQUANT_MODE = int(os.environ.get("FP4MOE_DEQUANT_MODE", "1" if INTERPRET else "4"))


def _mode(packed: torch.Tensor) -> int:
    return 0 if packed.dtype == torch.bfloat16 else DEQUANT_MODE


def block_m(num_tokens: int, top_k: int, num_experts: int) -> int:
    """Rows per expert block: 16 (the smallest tensor-core tile) for decode, up to 64 for prefill."""
    per_expert = num_tokens * top_k / num_experts
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


def _tiles(bm: int, n: int, k: int, rows: int = 1) -> tuple[int, int, int, int]:
    """(BN, BK, warps, stages) for a row block of ``bm`` and ``rows`` tokens in the launch (H200 sweep,
    benchmarks/tune_kernels.py: narrow N tiles while only a few experts are active)."""
    if bm <= 16:
        return (32 if rows <= 4 else 64), _block_k(k), 4, 4
    return 64, _block_k(k), 4, 3


def moe_gate_up(x, packed, scales, decode, routing: Routing, top_k: int, out=None, tiles=None):
    """x [T, H] bf16; packed [E, 2I, H/2] (or bf16 [E, 2I, H], scales unused) -> silu(gate) * up per pair
    [T*k, I] (rows = pair index)."""
    e, two_i, _ = packed.shape
    inter, hidden = two_i // 2, x.shape[1]
    tk = x.shape[0] * top_k
    bm = routing.bm
    bn, bk, warps, stages = tiles or _tiles(bm, inter, hidden, x.shape[0])
    if out is None:
        out = torch.empty(tk, inter, dtype=x.dtype, device=x.device)
    grid = (routing.blk_expert.numel(), triton.cdiv(inter, bn))
    s = uint8_view(scales)
    _w4a16_kernel[grid](
        x, x.stride(0), packed, s, decode, out, out.stride(0),
        routing.order, routing.blk_expert, routing.blk_start, routing.blk_count, routing.nblk, decode,
        0, inter, hidden, top_k,
        packed.stride(0), packed.stride(1), s.stride(0), s.stride(1), decode.stride(0),
        DENSE=False, MODE=_mode(packed), GATED=True, WEIGHTED=False, BM=bm, BN=bn, BK=bk, EVEN_K=hidden % bk == 0, DOT_F32=INTERPRET,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def moe_down(act, packed, scales, decode, routing: Routing, topk_weights, out=None, tiles=None):
    """act [T*k, I] (pair rows); packed [E, H, I/2] -> weight * down(act) per pair [T*k, H] (fp32)."""
    e, hidden, _ = packed.shape
    inter = act.shape[1]
    bm = routing.bm
    bn, bk, warps, stages = tiles or _tiles(bm, hidden, inter, act.shape[0] // max(1, topk_weights.shape[-1]))
    if out is None:
        out = torch.empty(act.shape[0], hidden, dtype=torch.float32, device=act.device)
    grid = (routing.blk_expert.numel(), triton.cdiv(hidden, bn))
    s = uint8_view(scales)
    _w4a16_kernel[grid](
        act, act.stride(0), packed, s, decode, out, out.stride(0),
        routing.order, routing.blk_expert, routing.blk_start, routing.blk_count, routing.nblk,
        topk_weights.reshape(-1),
        0, hidden, inter, 1,
        packed.stride(0), packed.stride(1), s.stride(0), s.stride(1), decode.stride(0) if decode.ndim else 0,
        DENSE=False, MODE=_mode(packed), GATED=False, WEIGHTED=True, BM=bm, BN=bn, BK=bk, EVEN_K=inter % bk == 0, DOT_F32=INTERPRET,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def nvfp4_linear(x, packed, scales, decode, out=None):
    """Dense NVFP4 linear: x [M, K] bf16, packed [N, K/2], scales [N, K/16], decode 0-D -> [M, N] bf16."""
    s = uint8_view(scales)
    return _dense(x, packed, s, s.stride(0), decode.reshape(1), DEQUANT_MODE, out)


def fp8_linear(x, weight, scale, out=None):
    """Per-tensor FP8 linear, weight-only: x [M, K] bf16, weight e4m3 [N, K], scale fp32 0-D -> [M, N] bf16
    (the engine's FP8 groups; vLLM runs these W8A8)."""
    w = uint8_view(weight)
    return _dense(x, w, w, 0, scale.reshape(1).float(), 3, out)


def _dense(x, w, s, stride_sn, d, mode: int, out):
    """One weight matrix over every row of x (the kernel's DENSE branch)."""
    m, k = x.shape
    n = w.shape[0]
    bm = 16 if m <= 16 else 64
    bn, bk, warps, stages = _tiles(bm, n, k)
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _w4a16_kernel[grid](
        x, x.stride(0), w, s, d, out, out.stride(0),
        d, d, d, d, d, d,
        m, n, k, 1,
        0, w.stride(0), 0, stride_sn, 0,
        DENSE=True, MODE=mode, GATED=False, WEIGHTED=False, BM=bm, BN=bn, BK=bk, EVEN_K=k % bk == 0, DOT_F32=INTERPRET,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


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
    return moe_pairs(experts, x, topk_ids, topk_weights).view(t, k, -1).sum(1)


def moe_pairs(experts, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """Each (token, expert) pair's weighted output [T*k, H] fp32 (pair = token * k + j)."""
    t, k = topk_ids.shape
    routing = align(topk_ids, experts.num_experts, block_m(t, k, experts.num_experts))
    if experts.quantized:
        gu = (experts.gate_up_packed, experts.gate_up_scales, experts.gate_up_decode)
        dn = (experts.down_packed, experts.down_scales, experts.down_decode)
    else:
        ones = experts.unit_scales()
        gu = (experts.gate_up_proj, experts.gate_up_proj, ones[0])
        dn = (experts.down_proj, experts.down_proj, ones[1])
    act = moe_gate_up(x, *gu, routing, k)
    return moe_down(act, *dn, routing, topk_weights.float())
