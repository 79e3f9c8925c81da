"""NVFP4 expert GEMVs on the tensor cores for decode: the weights as the MMA's M operand, dequantized in
registers, up to 8 tokens of one expert as its N operand (Gluon: layouts written out; sm89+ for the fp8 scales).

The CUDA-core GEMV (``nvfp4_gemv``) spends ~7 instructions per weight on the H200 (sm90 SASS: the
dequantization, a conversion to fp32 and a multiply-add per weight, and the activation passed through
shared memory because Triton lays it out apart from the weights); at batch 16 and more it is issue-bound,
and it reads an expert once per (token, expert) pair. Here a warp multiplies a [16, KC] weight tile by a
[KC, 8] tile of activations with ``mma.sync.m16n8k16`` (bf16 in, fp32 accumulate), where the 8 columns are
the tokens of one expert's row block (``moe_routing.align``; one pair per block at batch 1): the multiply
costs 1/8 instruction per weight and the weights are read once per block, not per pair.

The layouts make the dequantization free of data movement. In the MMA's A-operand layout with
``k_width`` 8 (``gl.DotOperandLayout(0, mma, 8)``), each thread holds 8 consecutive K positions of rows g
and g + 8: here those are 8 consecutive *bytes* of the packed codes (one 8-byte load), i.e. 16 weights of
one FP8 block scale. Each byte holds weights 2j (low nibble) and 2j + 1 (high nibble); the inline PTX of
``nvfp4_dequant`` (mode 7) turns four bytes into the bf16 bits of their even and of their odd weights, so the
product is two MMAs over the byte index j: the even weights against a[2j], the odd ones against a[2j + 1].
The B operand (activations) has the same k_width, so both operands agree on which j a register holds.
Values are mode 7's bit for bit (code bits times the block scale * 2^118 in bf16, the 2^8 left over applied
to the fp32 sum), so results differ from the GEMM only by fp32 summation order.

The warps of a program split K (a batch dimension of the MMA; summed once at the end), so a program of
``wk`` warps covers 16 output rows (gate/up: 16 gate and 16 up rows) over K in chunks of wk * KC bytes.
References: ``nvfp4_gemm.moe_reference``; the tests compare with it (GPU only: Gluon has no interpreter).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from fp4moe.kernels import pdl_args, uint8_view
from fp4moe.kernels.gl_helpers import pdl_wait, round_bf16
from fp4moe.kernels.moe_routing import Routing
from fp4moe.kernels.nvfp4_dequant import E2M1_BOTH, mode_of

TOKENS = 8  # the MMA's N: tokens of one expert per row block


@gluon.constexpr_function
def _scale_layout(sa):
    """The 4-D layout [wk, rows, kc/8, 8] that merges (last two dims) into ``sa``, the A-operand layout of
    [wk, rows, kc] with k_width 8 (registers: 8 consecutive bytes, row + 8, ...; lanes: 8-byte steps, rows
    0-7; warps: the K split). Block scales sliced from it (dim 3 gone) hold one scale per 8 bytes, and
    broadcast back along dim 3 they sit where the bytes of their 16 weights sit."""

    def split(v):
        return [v[0], v[1], v[2] >> 3, v[2] & 7]

    wk, rows, kc = sa.shape
    return gl.DistributedLinearLayout(
        [split(v) for v in sa.reg_bases if any(v)],
        [split(v) for v in sa.lane_bases],
        [split(v) for v in sa.warp_bases],
        [],
        [wk, rows, kc // 8, 8],
    )  # fmt: skip  (zero register bases -- registers repeated -- left out, as in _act_layout)


@gluon.constexpr_function
def _act_layout(sb):
    """The layout of activations [wk, 2 kc, 8] (weight k = 2 j + parity, token) whose even and odd k, split
    apart, are ``sb``, the B-operand layout of [wk, kc, 8] with k_width 8: the parity is the first register,
    so a thread's 8 consecutive bytes j are 16 consecutive activations (two 16-byte loads)."""

    def double(v):
        return [v[0], 2 * v[1], v[2]]

    wk, kc, n = sb.shape
    return gl.DistributedLinearLayout(
        [[0, 1, 0]] + [double(v) for v in sb.reg_bases if any(v)], [double(v) for v in sb.lane_bases],
        [double(v) for v in sb.warp_bases], [], [wk, 2 * kc, n],
    )  # fmt: skip


@gluon.jit
def _dequant(packed, sb, SA: gl.constexpr, S4: gl.constexpr):
    """Codes [wk, rows, KC] and scale bytes [wk, rows, KC/8] -> (even, odd) weights in the A-operand layout,
    bf16 bits of value * scale * 2^-8 (mode 7's values)."""
    s = sb.to(gl.float8e4nv, bitcast=True).to(gl.float32)
    s = (s * 3.3230699894622794e35).to(gl.bfloat16)  # * 2^118: exact
    s, _ = gl.broadcast(gl.expand_dims(s, 3), gl.zeros([s.shape[0], s.shape[1], s.shape[2], 8], gl.int8, S4))
    s = gl.convert_layout(gl.reshape(s, packed.shape), SA, assert_trivial=True)
    lo, hi = gl.inline_asm_elementwise(
        E2M1_BOTH, "=r,=r,=r,=r,r", [packed], dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=4
    )
    return lo * s, hi * s


@gluon.jit
def _split_act(a, WK: gl.constexpr, KC: gl.constexpr, SB: gl.constexpr):
    """Activations [wk, 2 KC, 8] -> (even k, odd k) [wk, KC, 8] in the B-operand layout (no data moves)."""
    even, odd = gl.split(gl.permute(gl.reshape(a, [WK, KC, 2, 8]), [0, 1, 3, 2]))
    return gl.convert_layout(even, SB, assert_trivial=True), gl.convert_layout(odd, SB, assert_trivial=True)


@gluon.jit
def _mma_gemv_kernel(
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
    N,
    TOPK,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_de,
    K: gl.constexpr,
    GATED: gl.constexpr,
    PAIRS: gl.constexpr,
    ROWS: gl.constexpr,
    WK: gl.constexpr,
    KC: gl.constexpr,
    PDL: gl.constexpr,
    TILE: gl.constexpr = 0,
):
    """Program (row block b, output rows): GATED: silu(gate) * up of rows n0..n0+15 (gate, tile rows 0-15)
    and N + n0.. (up, tile rows 16-31) for the block's tokens (rows pair // TOPK of a); else the down
    product of ROWS rows for the block's pair rows of a, times each pair's routing weight. Output rows are
    pairs. PAIRS: block b is pair b, of expert ``blk_expert[b]`` (the router's ids: no tables read). K is
    the weights' K; (K / 2) % (WK * KC) == 0, N % 16 == 0.

    The K steps are unrolled, each one's loads issued before the step ahead's MMAs. Down programs load
    their expert and their first step's weights before they wait for the kernel ahead: the block tables
    come from the align kernel or the router, two kernels back, which the gate/up launch waited for before
    it let this one start (``pdl_args("after_wait")``); read through L2 (".cg")."""
    MMA: gl.constexpr = gl.NVMMADistributedLayout(
        version=[2, 0], warps_per_cta=[WK, 1, 1], instr_shape=[1, 16, 8]
    )
    SA: gl.constexpr = gl.DotOperandLayout(0, MMA, 8)  # weights [WK, ROWS, KC]
    SB: gl.constexpr = gl.DotOperandLayout(1, MMA, 8)  # activations [WK, KC, 8]
    S4: gl.constexpr = _scale_layout(gl.to_linear_layout(SA, [WK, ROWS, KC]))
    AL: gl.constexpr = _act_layout(gl.to_linear_layout(SB, [WK, KC, 8]))
    SS: gl.constexpr = gl.SliceLayout(3, S4)  # block scales [WK, ROWS, KC / 8]
    EPI: gl.constexpr = gl.BlockedLayout([1, 1], [4, 8], [WK, 1], [1, 0])  # [16 or ROWS, 8] outputs
    STEP: gl.constexpr = WK * KC  # bytes of a row per step
    STEPS: gl.constexpr = K // 2 // STEP
    PRELOAD: gl.constexpr = not GATED

    b = gl.program_id(0)
    n0 = gl.program_id(1) * (16 if GATED else ROWS)
    if not PRELOAD:
        pdl_wait(PDL)
    if PAIRS:
        e = gl.load(blk_expert_ptr + b, cache_modifier=".cg").to(gl.int64)
        start = b
        count = 1
    else:  # (the compiler issues the table loads after the nblk test: two round trips)
        nblk = gl.load(nblk_ptr, cache_modifier=".cg")
        e = gl.load(blk_expert_ptr + b, cache_modifier=".cg").to(gl.int64)
        start = gl.load(blk_start_ptr + b, cache_modifier=".cg")
        count = gl.load(blk_count_ptr + b, cache_modifier=".cg")
        if b >= nblk:
            return
    d0 = gl.load(d_ptr + e * stride_de)
    if GATED:
        d1 = gl.load(d_ptr + e * stride_de + 1)

    # weights [WK, ROWS, KC]: warp w's bytes of the step, tile row r (gate/up: rows 16+ are the up rows)
    wa = gl.arange(0, WK, layout=gl.SliceLayout(1, gl.SliceLayout(2, SA)))
    ra = gl.arange(0, ROWS, layout=gl.SliceLayout(0, gl.SliceLayout(2, SA)))
    ja = gl.arange(0, KC, layout=gl.SliceLayout(0, gl.SliceLayout(1, SA)))
    ws = gl.arange(0, WK, layout=gl.SliceLayout(1, gl.SliceLayout(2, SS)))
    rs = gl.arange(0, ROWS, layout=gl.SliceLayout(0, gl.SliceLayout(2, SS)))
    js = gl.arange(0, KC // 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, SS)))
    if TILE:  # ``expert_layout``'s order: the program's rows of one step contiguous, its steps in turn
        gl.static_assert(TILE == STEP, "the launch's K step must be the experts' tile step")
        t0 = gl.program_id(1) * STEPS * ROWS
        row_w = (t0 + ra) * STEP
        row_sc = (t0 + rs) * (STEP // 8)
        WSTEP: gl.constexpr = ROWS * STEP
    else:  # row-major (gate/up: rows 16+ of the tile are the up rows, N on)
        row_w = (n0 + ra % 16 + (ra // 16) * N if GATED else n0 + ra) * stride_wn
        row_sc = (n0 + rs % 16 + (rs // 16) * N if GATED else n0 + rs) * stride_sn
        WSTEP: gl.constexpr = STEP
    w_ptrs = w_ptr + e * stride_we + (row_w[None, :, None] + (wa[:, None, None] * KC + ja[None, None, :]))
    s_ptrs = (
        s_ptr + e * stride_se + (row_sc[None, :, None] + (ws[:, None, None] * (KC // 8) + js[None, None, :]))
    )
    cw = gl.load(w_ptrs)
    cs = gl.load(s_ptrs)
    if PRELOAD:
        pdl_wait(PDL)

    # activations [WK, 2 KC, 8]: token t of the block, weight 2 j + parity of warp w's bytes
    wb = gl.arange(0, WK, layout=gl.SliceLayout(1, gl.SliceLayout(2, AL)))
    kb = gl.arange(0, 2 * KC, layout=gl.SliceLayout(0, gl.SliceLayout(2, AL)))
    tb = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, AL)))
    live = tb < count
    pairs = start + tb if PAIRS else gl.load(order_ptr + start + tb, mask=live, other=0)
    a_ptrs = a_ptr + (
        (pairs // TOPK).to(gl.int64)[None, None, :] * stride_am
        + (wb[:, None, None] * (2 * KC) + kb[None, :, None])
    )
    a_mask = (kb[None, :, None] >= 0) & live[None, None, :]

    acc = gl.zeros([WK, ROWS, 8], gl.float32, layout=MMA)
    for i in gl.static_range(STEPS):
        if i + 1 < STEPS:  # the next step's weights in flight during this one
            nw = gl.load(w_ptrs + (i + 1) * WSTEP)
            ns = gl.load(s_ptrs + (i + 1) * (WSTEP // 8))
        a_even, a_odd = _split_act(gl.load(a_ptrs + 2 * i * STEP, mask=a_mask, other=0.0), WK, KC, SB)
        lo, hi = _dequant(cw, cs, SA, S4)
        acc = mma_v2(lo, a_even, acc)
        acc = mma_v2(hi, a_odd, acc)
        if i + 1 < STEPS:
            cw = nw
            cs = ns

    y = gl.sum(acc, axis=0) * 256.0  # the bf16-bit dequantization leaves a factor 2^-8 in the weights
    ro = gl.arange(0, 16 if GATED else ROWS, layout=gl.SliceLayout(1, EPI))
    to = gl.arange(0, 8, layout=gl.SliceLayout(0, EPI))
    live_o = to < count
    pair_o = start + to if PAIRS else gl.load(order_ptr + start + to, mask=live_o, other=0)
    out_ptrs = out_ptr + pair_o.to(gl.int64)[None, :] * stride_om + (n0 + ro)[:, None]
    out_mask = (ro[:, None] >= 0) & live_o[None, :]
    if GATED:  # the CPU path rounds gate, up and silu(gate) to bf16 on the way; so do we
        g, u = gl.split(gl.permute(gl.reshape(y, [2, 16, 8]), [1, 2, 0]))
        gate = round_bf16(gl.convert_layout(g, EPI) * d0)
        up = round_bf16(gl.convert_layout(u, EPI) * d1)
        act = round_bf16(gate / (1.0 + gl.exp(-gate)))
        gl.store(out_ptrs, (act * up).to(gl.bfloat16), mask=out_mask)
    else:
        topw = round_bf16(gl.load(topw_ptr + pair_o, mask=live_o, other=0.0))
        y = round_bf16(gl.convert_layout(y, EPI) * d0) * topw[None, :]
        gl.store(out_ptrs, y.to(gl.bfloat16), mask=out_mask)


class MmaTiles:
    """Launch settings: warps splitting K (``wk``), packed bytes a warp takes per row per step (``kc``, a
    multiple of 32) and, for down, output rows per program (``rows``, 16 or 32; gate/up programs take 16
    gate and 16 up rows). ``for_k`` fits them to a K: halving kc, then wk, until wk * kc divides its bytes."""

    def __init__(self, wk: int, kc: int, rows: int = 16):
        if rows not in (16, 32):
            raise ValueError(f"rows = {rows}: 16 or 32")
        self.wk, self.kc, self.rows = wk, kc, rows

    def for_k(self, k: int) -> MmaTiles:
        if k % 64:
            raise ValueError(f"K = {k} is not a multiple of 64 (a warp's 8-byte rows over 4 lanes)")
        wk, kc = self.wk, self.kc
        while (k // 2) % (wk * kc):
            if kc > 32:
                kc //= 2
            else:
                wk //= 2
        return MmaTiles(wk, kc, self.rows)

    def __repr__(self) -> str:
        return f"MmaTiles(wk={self.wk}, kc={self.kc}, rows={self.rows})"


# H200, full-size experts (benchmarks/tune/tune_experts.py, tune_decode.py): within 2% of the best of the sweep at 16 and
# 64 tokens; one pair per block (batch 1, behind the CUDA-core gate/up) wants longer K steps
GATE_UP_TILES = MmaTiles(4, 32)
DOWN_TILES = MmaTiles(2, 32)
ONE_TOKEN_DOWN_TILES = MmaTiles(2, 64)


def fits(hidden: int, inter: int) -> bool:
    """Whether the expert shapes tile: both K (H for gate/up, I for down) multiples of 64."""
    return hidden % 64 == 0 and inter % 64 == 0


def tiles_for(tile: int, gated: bool) -> MmaTiles:
    """Launch settings for experts in ``expert_layout``'s order at ``tile``-byte steps (the K step must be the
    tile's): H200, 16 and 64 tokens, gate/up (2, 32) and down (1, 64) are the best of ``tune_experts.py --tiled``."""
    return MmaTiles(tile // 32, 32) if gated else MmaTiles(1, tile)


def _launch(a, w, s, decode, out, routing: Routing, topw, n, k, top_k, gated: bool, t: MmaTiles | None,
            default: MmaTiles, tile: int):  # fmt: skip
    """One launch: grid (row blocks, N / rows). A block table of one pair per block (``pair_routing(ids,
    1)``) runs without reading it (PAIRS). ``tile``: the experts' byte order (``expert_layout``; 0: row-major);
    ``t`` None: ``tiles_for(tile)``, or ``default`` for row-major experts."""
    t = (t or (tiles_for(tile, gated) if tile else default)).for_k(k)
    if tile and (t.wk * t.kc != tile or (not gated and t.rows != 16)):
        raise ValueError(f"{t} does not read experts tiled at {tile}-byte steps (see tiles_for)")
    rows = 16 if gated else t.rows
    if n % rows:
        raise ValueError(f"N = {n} is not a multiple of {rows} (the program's rows)")
    if routing.bm > TOKENS:
        raise ValueError(f"row blocks of {routing.bm} pairs; this kernel takes at most {TOKENS}")
    _mma_gemv_kernel[(routing.blk_expert.numel(), n // rows)](
        a, a.stride(0), w, s, decode, out, out.stride(0), routing.order, routing.blk_expert, routing.blk_start,
        routing.blk_count, routing.nblk, topw, n, top_k, w.stride(0), w.stride(1), s.stride(0), s.stride(1),
        decode.stride(0), K=k, GATED=gated, PAIRS=routing.bm == 1, ROWS=32 if gated else t.rows, WK=t.wk,
        KC=t.kc, TILE=tile, num_warps=t.wk, **pdl_args("after_wait" if gated else ""),
    )  # fmt: skip
    return out


def _check_mode(packed) -> None:
    if mode_of(packed) != 7:
        raise ValueError(
            "the tensor-core GEMV takes NVFP4 experts with the inline-PTX dequantization (mode 7)"
        )


def mma_gate_up(x, packed, scales, decode, routing: Routing, top_k: int, out=None, tiles: MmaTiles | None = None,
                tile: int = 0):  # fmt: skip
    """x [T, H] bf16; packed [E, 2I, H/2] NVFP4 -> silu(gate) * up per pair [T*k, I] bf16 (row = pair).
    ``tile``: the experts' byte order (``expert_layout``)."""
    _check_mode(packed)
    two_i, hidden = packed.shape[1], x.shape[1]
    if out is None:
        out = torch.empty(x.shape[0] * top_k, two_i // 2, dtype=x.dtype, device=x.device)
    s = uint8_view(scales)
    return _launch(
        x, packed, s, decode, out, routing, decode, two_i // 2, hidden, top_k, True, tiles, GATE_UP_TILES, tile
    )  # fmt: skip


def mma_down(act, packed, scales, decode, routing: Routing, topk_weights, out=None, tiles: MmaTiles | None = None,
             tile: int = 0):  # fmt: skip
    """act [T*k, I] bf16 (pair rows); packed [E, H, I/2] -> weight * down(act) per pair [T*k, H] bf16."""
    _check_mode(packed)
    hidden, inter = packed.shape[1], act.shape[1]
    if out is None:
        out = torch.empty(act.shape[0], hidden, dtype=torch.bfloat16, device=act.device)
    s = uint8_view(scales)
    topw = topk_weights.reshape(-1).float()
    return _launch(
        act, packed, s, decode, out, routing, topw, hidden, inter, 1, False, tiles, DOWN_TILES, tile
    )
