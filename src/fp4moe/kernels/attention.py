"""Gated attention on a paged KV cache.

- ``qk_norm_rope_store``: per token and head, the zero-centred RMSNorm of q/k, rotary on the first R dims
  (rotate-half within them), and the write of k/v into their cache pages (bf16, or fp8-e4m3 with one scale
  per layer and tensor); q goes to a [T, H, D] buffer.
- ``paged_decode_attention``: one query token per sequence over its pages, split along the sequence
  (flash-decoding) so that batch 1 fills the GPU; one program per (sequence, KV head, split) handles the
  whole GQA group. A second kernel merges the splits and applies the output gate sigmoid(gate).
- ``paged_prefill_attention``: the rows of a step whose sequences continue (a prompt's later chunks, a
  prefix-cache hit, mixed steps) over their pages, flash-attention style: one program per (TOK query tokens
  of one sequence, KV head) holds the TOK x G rows of the GQA group, so each K/V tile read from the pages
  serves every head that shares it; causal from each row's position, fp8 pages read as bytes.
- ``output_gate``: a prefill's attention output times sigmoid(gate), the gate read where q_proj wrote it,
  rounded as the decode merge rounds it (and as torch's sigmoid and product do).
References: ``layers.attention`` (``attend``) and ``engine.reference.cache.KVCache`` (fp8 encoding)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4moe.kernels import INTERPRET, gpu_arch, next_pow2, pdl_args, uint8_view
from fp4moe.kernels.tl_helpers import e4m3_to_f16, fp8e4m3_bytes, round_bf16, wait_for_previous


@triton.jit
def _qk_norm_rope_kernel(
    qkv_ptr, stride_t, cos_ptr, sin_ptr, qn_ptr, kn_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, slot_map_ptr,
    kv_scale_ptr, eps,
    H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, R: tl.constexpr, FP8: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous(PDL)
    t = tl.program_id(0)
    j = tl.program_id(1)
    row = qkv_ptr + t.to(tl.int64) * stride_t
    d = tl.arange(0, D)
    is_q = j < H
    if is_q:
        base = row + j * 2 * D
        w_ptr = qn_ptr
    else:
        base = row + H * 2 * D + (j - H) * D
        w_ptr = kn_ptr
    x = tl.load(base + d).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 0) / D + eps)
    xn = round_bf16(x * rstd * (1.0 + tl.load(w_ptr + d).to(tl.float32)))
    half = R // 2
    partner = tl.where(d < half, d + half, d - half)
    xp = tl.load(base + partner).to(tl.float32)
    xpn = round_bf16(xp * rstd * (1.0 + tl.load(w_ptr + partner).to(tl.float32)))
    rotated = tl.where(d < half, -xpn, xpn)
    in_rot = d < R
    cos = tl.load(cos_ptr + t * R + d, mask=in_rot, other=1.0).to(tl.float32)
    sin = tl.load(sin_ptr + t * R + d, mask=in_rot, other=0.0).to(tl.float32)
    out = round_bf16(tl.where(in_rot, xn * cos + rotated * sin, xn))
    if is_q:
        tl.store(q_out_ptr + (t.to(tl.int64) * H + j) * D + d, out.to(q_out_ptr.dtype.element_ty))
    else:
        kh = j - H
        slot = tl.load(slot_map_ptr + t).to(tl.int64)  # page * page_size + offset
        dst = (slot * HKV + kh) * D + d
        v = tl.load(row + H * 2 * D + HKV * D + kh * D + d).to(tl.float32)
        if FP8:
            ks = tl.load(kv_scale_ptr)
            vs = tl.load(kv_scale_ptr + 1)
            kq = fp8e4m3_bytes(tl.clamp(out / ks, -448.0, 448.0), FP8 == 2)  # 2: by bits (gpu_arch.SOFT)
            vq = fp8e4m3_bytes(tl.clamp(v / vs, -448.0, 448.0), FP8 == 2)
            tl.store(k_cache_ptr + dst, kq)
            tl.store(v_cache_ptr + dst, vq)
        else:
            tl.store(k_cache_ptr + dst, out.to(k_cache_ptr.dtype.element_ty))
            tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty))


def qk_norm_rope_store(
    qkv, cos, sin, q_norm, k_norm, k_cache, v_cache, slot_mapping, kv_scales, eps, dims, q_out=None
):
    """qkv [T, H*2D + 2*Hkv*D] (q|gate per head, then k, then v); cos/sin [T, R]; caches
    [pages, page_size, Hkv, D]; slot_mapping [T] -> q [T, H, D] (k/v written into the caches)."""
    h, hkv, d = dims
    t = qkv.shape[0]
    if q_out is None:
        q_out = torch.empty(t, h, d, dtype=qkv.dtype, device=qkv.device)
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    _qk_norm_rope_kernel[(t, h + hkv)](
        qkv, qkv.stride(0), cos, sin, q_norm, k_norm, q_out, uint8_view(k_cache), uint8_view(v_cache),
        slot_mapping, kv_scales, eps, H=h, HKV=hkv, D=d, R=cos.shape[-1], FP8=_fp8(fp8, qkv), **pdl_args(),
    )  # fmt: skip
    return q_out


def _fp8(fp8: bool, t: torch.Tensor):
    """The kernels' ``FP8`` constexpr: False for a bf16 cache, else ``gpu_arch.fp8_flag`` of the device."""
    return gpu_arch.fp8_flag(t.device) if fp8 else False


@triton.jit
def _online_softmax(s, v, m_i, l_i, acc, DOT_F32: tl.constexpr):
    """One key tile of flash attention: scores s [rows, keys] scaled by softmax scale x log2(e) (-inf where
    masked), values v [keys, D] -> the running max (log2 units), sum and output accumulator (rows x D,
    fp32) after it."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if DOT_F32:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32))
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _kv_tile(k_cache_ptr, v_cache_ptr, kv_off, valid, FP8: tl.constexpr, MASKED: tl.constexpr = True):
    """Keys and values at ``kv_off`` [keys, D] (rows not ``valid``: zeros; ``MASKED`` False: every row is);
    an fp8 cache's bytes as fp16 (e4m3 is exact in it: one conversion, the scales go on the scores and
    the output; ``FP8`` 2, ``gpu_arch.SOFT``: converted by bits, on GPUs without e4m3 conversions)."""
    if MASKED:
        k = tl.load(k_cache_ptr + kv_off, mask=valid[:, None], other=0)
        v = tl.load(v_cache_ptr + kv_off, mask=valid[:, None], other=0)
    else:
        k = tl.load(k_cache_ptr + kv_off)
        v = tl.load(v_cache_ptr + kv_off)
    if FP8 == 2:
        k = e4m3_to_f16(k)
        v = e4m3_to_f16(v)
    elif FP8:
        k = k.to(tl.float8e4nv, bitcast=True).to(tl.float16)
        v = v.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    return k, v


# the number of splits follows the step's sequences and cache length: a runtime value, not a variant per
# count (a served step of 45 rows once waited 1.1 s for a compile of its own, issue 20)
@triton.jit(do_not_specialize=["nsplit"])
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, stride_bt, seq_lens_ptr, kv_scale_ptr,
    part_o_ptr, part_ml_ptr, sm_scale, split_len, nsplit,
    H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
    PAGE: tl.constexpr, FP8: tl.constexpr, DOT_F32: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous(PDL)
    b = tl.program_id(0)
    kh = tl.program_id(1)
    sp = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    heads = kh * G + g
    q = tl.load(
        q_ptr + (b.to(tl.int64) * H + heads[:, None]) * D + d[None, :], mask=g[:, None] < G, other=0.0
    )
    q = q.to(tl.bfloat16)
    m_i = tl.full((GP,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((GP,), dtype=tl.float32)
    acc = tl.zeros((GP, D), dtype=tl.float32)
    start = sp * split_len
    end = tl.minimum(start + split_len, seq_len)
    # an fp8 cache's per-layer scales multiply the scores and the output, not every cached element: e4m3
    # values are exact in fp16, so K and V go from their bytes to the dots with one conversion (scaling and
    # rounding each element cost more than reading it: fp8 decode ran at 44% of its roofline, bf16 at 82%)
    qk_scale = sm_scale
    if FP8:  # the dots in fp16: e4m3 converts to it in one instruction per pair, and it holds q (above 2^-14)
        qk_scale = sm_scale * tl.load(kv_scale_ptr)
        q = q.to(tl.float16)
    offs = tl.arange(0, PAGE)
    for p0 in range(start, end, PAGE):
        page = tl.load(block_table_ptr + b.to(tl.int64) * stride_bt + p0 // PAGE).to(tl.int64)
        valid = p0 + offs < end
        kv_off = ((page * PAGE + offs[:, None]) * HKV + kh) * D + d[None, :]
        k, v = _kv_tile(k_cache_ptr, v_cache_ptr, kv_off, valid, FP8)
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32))) if DOT_F32 else tl.dot(q, tl.trans(k))
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_i, l_i, acc = _online_softmax(s, v, m_i, l_i, acc, DOT_F32)
    if FP8:
        acc = acc * tl.load(kv_scale_ptr + 1)
    part = (b.to(tl.int64) * H + heads) * nsplit + sp
    tl.store(part_o_ptr + part[:, None] * D + d[None, :], acc, mask=g[:, None] < G)
    tl.store(part_ml_ptr + part * 2, m_i, mask=g < G)
    tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=g < G)


@triton.jit(do_not_specialize=["nsplit"], do_not_specialize_on_alignment=["qkv_ptr"])
def _decode_merge_kernel(
    part_o_ptr, part_ml_ptr, qkv_ptr, stride_t, out_ptr, nsplit,
    H: tl.constexpr, D: tl.constexpr, NSP: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """Merges a (sequence, head)'s ``nsplit`` partial results, NSP >= nsplit (a power of two: one of
    ``MERGE_WIDTHS``), times sigmoid of the head's gate."""
    wait_for_previous(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, NSP)
    d = tl.arange(0, D)
    base = (b.to(tl.int64) * H + h) * nsplit
    m = tl.load(part_ml_ptr + (base + s) * 2, mask=s < nsplit, other=float("-inf"))
    l = tl.load(part_ml_ptr + (base + s) * 2 + 1, mask=s < nsplit, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.where(l > 0, tl.exp2(m - m_max), 0.0)  # the splits' maxima are in log2 units
    o = tl.load(
        part_o_ptr + (base + s)[:, None] * D + d[None, :],
        mask=(s[:, None] < nsplit) & (l[:, None] > 0),
        other=0.0,
    )
    out = round_bf16(tl.sum(o * w[:, None], 0) / tl.sum(l * w, 0))
    gate = tl.load(qkv_ptr + b.to(tl.int64) * stride_t + h * 2 * D + D + d).to(tl.float32)
    y = round_bf16(out * round_bf16(tl.sigmoid(gate)))
    tl.store(out_ptr + (b.to(tl.int64) * H + h) * D + d, y.to(out_ptr.dtype.element_ty))


@triton.jit
def _output_gate_kernel(
    o_ptr, so_t, so_h, g_ptr, sg_t, sg_h, out_ptr, H, D,
    HB: tl.constexpr, BD: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, HB)[:, None].to(tl.int64)
    d = tl.arange(0, BD)[None, :]
    mask = (h < H) & (d < D)
    o = tl.load(o_ptr + t * so_t + h * so_h + d, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + t * sg_t + h * sg_h + d, mask=mask, other=0.0).to(tl.float32)
    y = round_bf16(o * round_bf16(tl.sigmoid(g)))
    tl.store(out_ptr + (t * H + h) * D + d, y.to(out_ptr.dtype.element_ty), mask=mask)


def output_gate(out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Attention output out [T, H, D] times sigmoid(gate [T, H, D]) -> [T, H * D] contiguous: one pass, both
    read at their own strides (unit along D; the gate straight out of q_proj's query/gate rows), where torch
    copies the gate, then runs the sigmoid and the product (an 8K prefill on the H200: ~1.6 ms over its 10
    attention layers). Rounded where torch rounds (sigmoid to bf16, then the product), as the decode merge."""
    t, h, d = out.shape
    if gate.shape != out.shape or out.stride(-1) != 1 or gate.stride(-1) != 1:
        raise ValueError(
            f"output_gate: out {tuple(out.shape)} and gate {tuple(gate.shape)} must match, unit stride along D"
        )
    y = torch.empty(t, h * d, dtype=out.dtype, device=out.device)
    if t:
        _output_gate_kernel[(t,)](
            out, out.stride(0), out.stride(1), gate, gate.stride(0), gate.stride(1), y, h, d,
            HB=next_pow2(h), BD=next_pow2(d), num_warps=4, **pdl_args(),
        )  # fmt: skip
    return y


# programs the decode split kernel aims for: the H200's 132 SMs about twice; under Triton's interpreter (CI)
# every program costs host time and there is no GPU to fill, so one split per sequence and head there
# (tests/kernels checks several splits against the reference with target_programs given)
DECODE_TARGET_PROGRAMS = 1 if INTERPRET else 264


MAX_SPLITS = 128  # the merge holds a (sequence, head)'s splits in registers
# the merge kernel's widths (its one constexpr that varies): the warm-up compiles each (``warm_decode_merge``)
MERGE_WIDTHS = tuple(2**i for i in range(MAX_SPLITS.bit_length()))


def split_len_for(
    max_len: int, page: int, programs: int, min_split: int | None = None, max_splits: int = MAX_SPLITS,
    target_programs: int | None = None,
) -> int:  # fmt: skip
    """Tokens per split, whole pages: enough splits that (sequences x KV heads x splits) reaches
    ``target_programs`` (default DECODE_TARGET_PROGRAMS), at most ``max_splits`` (the merge holds them all
    in registers)."""
    target = DECODE_TARGET_PROGRAMS if target_programs is None else target_programs
    want = min(max_splits, max(1, -(-target // programs)))
    split = max(min_split or page, -(-max_len // want))
    return -(-split // page) * page


def paged_decode_attention(
    q,
    qkv,
    k_cache,
    v_cache,
    block_table,
    seq_lens,
    kv_scales,
    max_len: int,
    dims,
    out=None,
    buffers=None,
    min_split: int | None = None,
    target_programs: int | None = None,
):
    """q [B, H, D] (one token per sequence, already in the cache), qkv [B, ...] (its gate half),
    block_table [B, pages], seq_lens [B] (tokens incl. this one) -> [B, H*D] = attn * sigmoid(gate).
    ``max_len`` bounds seq_lens (fixes the split grid, so the launch is graph-capturable)."""
    h, hkv, d = dims
    b = q.shape[0]
    page = k_cache.shape[1]
    split = split_len_for(max_len, page, b * hkv, min_split, target_programs=target_programs)
    nsplit = -(-max_len // split)
    if buffers is None:
        buffers = (
            torch.empty(b * h * nsplit, d, dtype=torch.float32, device=q.device),
            torch.empty(b * h * nsplit, 2, dtype=torch.float32, device=q.device),
        )
    part_o, part_ml = buffers
    if out is None:
        out = torch.empty(b, h * d, dtype=q.dtype, device=q.device)
    g = h // hkv
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    _decode_split_kernel[(b, hkv, nsplit)](
        q, uint8_view(k_cache), uint8_view(v_cache), block_table, block_table.stride(0), seq_lens, kv_scales,
        part_o, part_ml, d**-0.5 * LOG2E, split, nsplit,
        H=h, HKV=hkv, D=d, G=g, GP=max(16, next_pow2(g)), PAGE=page, FP8=_fp8(fp8, q), DOT_F32=INTERPRET,
        num_warps=4, num_stages=2, **pdl_args(),
    )  # fmt: skip
    _decode_merge(part_o, part_ml, qkv, out, b, nsplit, h, d)
    return out


def _decode_merge(part_o, part_ml, qkv, out, rows: int, nsplit: int, h: int, d: int) -> None:
    _decode_merge_kernel[(rows, h)](
        part_o, part_ml, qkv, qkv.stride(0), out, nsplit, H=h, D=d, NSP=next_pow2(nsplit),
        **pdl_args("start"),  # the output projection's GEMV loads its first tile meanwhile
    )  # fmt: skip


def warm_decode_merge(qkv: torch.Tensor, dims) -> None:
    """Compiles the decode merge for every width in ``MERGE_WIDTHS`` (the split kernel has one variant): a
    step's count of splits follows its number of rows, which the warm-up's steps do not all meet. ``qkv``:
    one row laid out as the attention layers' projections (its stride is part of the variant)."""
    h, _, d = dims
    out = torch.empty(1, h * d, dtype=qkv.dtype, device=qkv.device)  # the compute dtype, as a step's
    for width in MERGE_WIDTHS:
        part_o = torch.zeros(h * width, d, dtype=torch.float32, device=qkv.device)
        part_ml = torch.zeros(h * width, 2, dtype=torch.float32, device=qkv.device)
        part_ml[:, 1] = 1.0
        _decode_merge(part_o, part_ml, qkv[:1], out, 1, width, h, d)


# the step's layout tensors are views at offsets that depend on its number of sequences, and the fp8
# scales one layer's row of a table: not specializing on their alignment keeps it to one compile (issue 20)
@triton.jit(
    do_not_specialize_on_alignment=[
        "blocks_ptr",
        "slots_ptr",
        "cached_ptr",
        "starts_ptr",
        "ends_ptr",
        "kv_scale_ptr",
    ]
)
def _prefill_paged_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, stride_bt, out_ptr, blocks_ptr, slots_ptr, cached_ptr,
    starts_ptr, ends_ptr, kv_scale_ptr, qk_scale,
    H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, G: tl.constexpr, TOK: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, PAGE: tl.constexpr, FP8: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    blk = tl.program_id(0)
    kh = tl.program_id(1)
    seq = tl.load(blocks_ptr + blk * 2)
    t0 = tl.load(blocks_ptr + blk * 2 + 1) * TOK  # first query token of this program, within its sequence
    slot = tl.load(slots_ptr + seq)
    cached = tl.load(cached_ptr + seq)
    first = tl.load(starts_ptr + seq).to(tl.int64)  # its first row in the flat batch
    n = tl.load(ends_ptr + seq) - first
    r = tl.arange(0, BM)
    tok = t0 + r // G
    head = kh * G + r % G
    live = (r < TOK * G) & (tok < n)
    pos = cached + tok  # each row's position: it sees keys 0..pos
    d = tl.arange(0, D)
    q_off = ((first + tok) * H + head)[:, None] * D + d[None, :]
    q = tl.load(q_ptr + q_off, mask=live[:, None], other=0.0)
    if FP8:  # as in the decode kernel: e4m3 is exact in fp16, the scales go on the scores and the output
        q = q.to(tl.float16)
        qk_scale = qk_scale * tl.load(kv_scale_ptr)
    m_i = tl.full((BM,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BM,), dtype=tl.float32)
    acc = tl.zeros((BM, D), dtype=tl.float32)
    bt = block_table_ptr + slot.to(tl.int64) * stride_bt
    cols = tl.arange(0, BN)
    # keys every row of the program sees (below its first row's position), whole tiles: no mask; a program
    # past its sequence's rows (a graphed chunk's padding) reads none
    some = t0 < n
    seen = tl.where(some, (cached + t0 + 1) // BN * BN, 0)
    for n0 in range(0, seen, BN):
        key = n0 + cols
        page = tl.load(bt + key // PAGE).to(tl.int64)
        kv_off = ((page * PAGE + key % PAGE) * HKV + kh)[:, None] * D + d[None, :]
        k, v = _kv_tile(k_cache_ptr, v_cache_ptr, kv_off, key, FP8, False)
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32))) if DOT_F32 else tl.dot(q, tl.trans(k))
        m_i, l_i, acc = _online_softmax(s * qk_scale, v, m_i, l_i, acc, DOT_F32)
    # then the tiles up to the program's last row, causal per row
    end = tl.where(some, cached + tl.minimum(t0 + TOK, n), 0)
    for n0 in range(seen, end, BN):
        key = n0 + cols
        inside = key < end
        page = tl.load(bt + key // PAGE, mask=inside, other=0).to(tl.int64)
        kv_off = ((page * PAGE + key % PAGE) * HKV + kh)[:, None] * D + d[None, :]
        k, v = _kv_tile(k_cache_ptr, v_cache_ptr, kv_off, inside, FP8)
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32))) if DOT_F32 else tl.dot(q, tl.trans(k))
        s = tl.where(key[None, :] <= pos[:, None], s * qk_scale, float("-inf"))  # key 0: seen by every row
        m_i, l_i, acc = _online_softmax(s, v, m_i, l_i, acc, DOT_F32)
    out = acc / tl.maximum(l_i, 1.0)[:, None]  # a live row's sum holds its largest score's 1; others are 0
    if FP8:
        out = out * tl.load(kv_scale_ptr + 1)
    tl.store(out_ptr + q_off, out.to(out_ptr.dtype.element_ty), mask=live[:, None])


LOG2E = 1.4426950408889634  # the kernels' softmax runs on exp2: scores carry the scale x log2(e)
# rows (query tokens x GQA group), keys per tile, warps, stages: the H200's best of a sweep at a 512K prefix
# (benchmarks/long_context.py --tiles): bf16 pages 443 TFLOP/s (157 with 64 rows of 4 warps), fp8 pages 388
# with 128-key tiles unpipelined (305 with bf16's tile: the conversions want the registers)
PREFILL_TILES = {False: (128, 64, 8, 2), True: (128, 128, 8, 1)}  # by fp8


def prefill_tokens_per_program(group: int, rows: int) -> int:
    """Query tokens per program: as many as fill ``rows`` rows with a whole GQA group each."""
    return max(1, rows // group)


def prefill_block_tokens(group: int, fp8: bool) -> int:
    """Query tokens per program of ``paged_prefill_attention`` with its default tile for the cache's dtype:
    the block size of the ``blocks`` it takes."""
    return prefill_tokens_per_program(group, PREFILL_TILES[fp8][0])


def paged_prefill_attention(
    q, k_cache, v_cache, block_table, step, blocks, kv_scales, dims, out=None, tile=None
):
    """q [T, H, D] (the step's rows, their k/v already in the pages); ``step``: the step's layout
    (``StepTensors``: slots, cached, starts, ends); ``blocks`` [programs, 2]: (sequence, block of
    ``prefill_tokens_per_program`` tokens within it), ``StepContext.chunk_indices`` -> [T, H, D], each row
    attending causally to its sequence's keys 0..its position."""
    h, hkv, d = dims
    g = h // hkv
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    rows, cols, warps, stages = tile or PREFILL_TILES[fp8]
    tok = prefill_tokens_per_program(g, rows)
    bm = max(16, next_pow2(tok * g))
    if out is None:
        out = torch.empty_like(q)
    _prefill_paged_kernel[(blocks.shape[0], hkv)](
        q, uint8_view(k_cache), uint8_view(v_cache), block_table, block_table.stride(0), out, blocks,
        step.slots, step.cached, step.starts, step.ends, kv_scales, d**-0.5 * LOG2E,
        H=h, HKV=hkv, D=d, G=g, TOK=tok, BM=bm, BN=cols, PAGE=k_cache.shape[1], FP8=_fp8(fp8, q), DOT_F32=INTERPRET,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out
