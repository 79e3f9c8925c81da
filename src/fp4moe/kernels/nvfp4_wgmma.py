"""Grouped NVFP4 (W4A16) expert GEMMs for prefill on Hopper (sm90): wgmma with the dequantized weights as its
register operand, in a layout that makes the dequantization move no data (Gluon: layouts written out).

``nvfp4_moe_prefill``'s Triton kernel spends ~924 SASS instructions per 128-wide K step of a 64 x 128 gate/up
tile and warp (sm90, its own compile): Triton lays the dequantized weights out apart from the MMA's register
operand, so every code byte is loaded alone from shared memory (LDS.U8) and the bf16 pairs are rebuilt with
PRMTs. The H200's tensor cores then wait on the issue slots (gate/up 279 TFLOP/s, down 206, of a measured
786 bf16 peak at an 8K prefill).

Here each thread reads exactly the code bytes its wgmma register fragment needs, 16 contiguous bytes per row
and step (one 16-byte shared-memory load, after a cp.async copy of the step's bytes), and turns each 4 bytes into
four bf16 pairs with ``nvfp4_dequant``'s inline PTX (``E2M1_BOTH``). Those pairs are (code 2i, code 2i + 2) of
a byte's low nibbles, or of its high nibbles: not the (k, k + 1) pairs the fragment holds. So the MMA runs over
K in another order -- within each 128-wide chunk, logical position kappa = 32 j + 16 h + 8 q + 2 c + t takes
physical k = 32 c + 8 j + 4 q + 2 t + h (``k_order``) -- and the activations are stored in that order
(``k_order``: the post-attention norm writes gate/up's input in it too, else ``permute_k``; the gate/up
launch writes its output in it for down, ``PERMUTE_OUT``). The weights keep their bytes and order (``expert_layout``), shared with the decode kernels.
The same gate/up step compiles to ~453 instructions a warp here (sm90, no spills).

Activations reach shared memory by cp.async in a ring of ``STAGES`` chunks; both projections' MMAs of a
chunk run asynchronously while the next chunk's weights are dequantized. Values are mode 7's bit for bit
(code bits times the block scale * 2^118 in bf16, the 2^8 left over applied to the fp32 sum), with
``nvfp4_moe_prefill``'s epilogues and roundings, so results differ from it by the fp32 summation order and
the SiLU's formula (gate / (1 + exp(-gate)), as ``nvfp4_mma_gemv``; it: gate * sigmoid(gate)).

GPU only (Gluon has no interpreter); off unless ``FP4MOE_WGMMA_PREFILL=1`` (``moe_dispatch.WGMMA_PREFILL``)
until it has run and been measured on the H200: written and compiled for sm90 without a GPU. References:
``nvfp4_gemm.moe_reference``; the K order (``k_order``) has CPU tests of its own."""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from fp4moe.kernels import pdl_args
from fp4moe.kernels.expert_layout import tiled_offsets
from fp4moe.kernels.gl_helpers import pdl_wait, round_bf16
from fp4moe.kernels.k_order import STEP_K, TO_LOGICAL, permute_k
from fp4moe.kernels.moe_routing import Routing
from fp4moe.kernels.nvfp4_dequant import E2M1_BOTH

ROWS = 64  # weight rows of a program by default (gate/up: 64 gate and the same 64 up rows): one warpgroup
CHUNK = gl.constexpr(STEP_K)
# ``k_order``'s reorder, as the kernel applies it to a step's dequantized nibbles [rows, c, j, q, t, h] and to the
# gate/up epilogue's rows [c (or c0 of one half), j, q, t, h, pairs]
W_ORDER = gl.constexpr((0, *(d + 1 for d in TO_LOGICAL)))
Y_ORDER = gl.constexpr((*TO_LOGICAL, 5))


# ---- layouts ----------------------------------------------------------------------------------------


@gluon.constexpr_function
def _code_layout(sa):
    """The layout of one step's code bytes [BN, 64] whose two nibbles (joined last), reordered into logical K
    (``_weights``), are ``sa``, the A-operand layout of [BN, 128]: logical bit t -> byte bit 0, q -> 1, j -> 2-3,
    c -> 4-5, h -> the nibble. A thread's 16 bytes of a row come first in its registers (one 16-byte load, four
    4-byte groups for the inline PTX)."""
    to_byte = {1: 1, 2: 16, 4: 32, 8: 2, 16: 0, 32: 4, 64: 8}

    def byte(v):
        return [v[0], to_byte[v[1]] if v[1] else 0]

    regs = [byte(v) for v in sa.reg_bases if v[1] != 16]
    regs = sorted([r for r in regs if r[1]], key=lambda r: r[1]) + [r for r in regs if not r[1]]
    return gl.DistributedLinearLayout(
        regs, [byte(v) for v in sa.lane_bases], [byte(v) for v in sa.warp_bases], [], [sa.shape[0], 64]
    )


@gluon.constexpr_function
def _scale_layout(code):
    """[BN, 8, 8] (row, 16-weight block, byte of the block) that merges into ``code``'s layout; sliced (dim 2
    gone) it holds each thread's block scales: two bytes of each of its rows."""

    def split(v):
        return [v[0], v[1] >> 3, v[1] & 7]

    return gl.DistributedLinearLayout(
        [split(v) for v in code.reg_bases], [split(v) for v in code.lane_bases],
        [split(v) for v in code.warp_bases], [], [code.shape[0], 8, 8],
    )  # fmt: skip


# ---- the kernel -------------------------------------------------------------------------------------


@gluon.jit
def _weights(codes, sbytes, CODE: gl.constexpr, S3: gl.constexpr, SA: gl.constexpr):
    """One step's codes [BN, 64] and scale bytes [BN, 8] -> bf16 weights [BN, 128] in logical K order and the
    A-operand layout (value * scale * 2^-8, mode 7's bits), no data moved between threads or registers."""
    s = sbytes.to(gl.float8e4nv, bitcast=True).to(gl.float32)
    s = (s * 3.3230699894622794e35).to(gl.bfloat16)  # * 2^118: exact
    s, _ = gl.broadcast(gl.expand_dims(s, 2), gl.zeros([s.shape[0], 8, 8], gl.int8, S3))
    s = gl.convert_layout(gl.reshape(s, codes.shape), CODE, assert_trivial=True)
    lo, hi = gl.inline_asm_elementwise(
        E2M1_BOTH, "=r,=r,=r,=r,r", [codes], dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=4
    )
    w = gl.join(lo * s, hi * s)  # [BN, 64 bytes = (c, j, q, t), h]
    w = gl.permute(gl.reshape(w, [codes.shape[0], 4, 4, 2, 2, 2]), W_ORDER.value)  # (j, h, q, c, t)
    return gl.convert_layout(gl.reshape(w, [codes.shape[0], 128]), SA, assert_trivial=True)


@gluon.jit
def _out_columns(n0, lam):
    """The columns of the gate/up epilogue's reordered rows ``lam`` (``Y_ORDER``: lam = 16 j + 8 h + 4 q + 2 c0 +
    t of a program's rows n0 + 32 c0 + 8 j + 4 q + 2 t + h) in the down launch's K order: logical 32 j + 16 h +
    8 q + 2 c + t of their chunk, c = 2 c1 + c0 with c1 = bit 6 of n0."""
    return (n0 // 128) * 128 + ((lam >> 2) << 3) + (((n0 >> 6) & 1) << 2) + (lam & 3)


@gluon.jit
def _copy_step(acts, codes, scales, slot, step, a_ptrs, w_base, s_base, rows_w, bytes_w, rows_s, bytes_s,
               stride_wn, stride_sn, N, GATED: gl.constexpr, TILE: gl.constexpr):  # fmt: skip
    """Issue the cp.async copies of K step ``step`` into ring ``slot``: the activations, and the code and scale
    bytes of weight rows ``rows_w`` / ``rows_s`` (gate/up: rows N on are up rows), addressed in the experts'
    byte order by ``expert_layout.tiled_offsets`` (64-byte steps, 8 for scales; TILE 0: row-major)."""
    async_copy.async_copy_global_to_shared(acts.index(slot), a_ptrs + step * CHUNK)
    w_off = tiled_offsets(rows_w, step * 64 + bytes_w, stride_wn, N, GATED, TILE)
    async_copy.async_copy_global_to_shared(codes.index(slot), w_base + w_off)
    s_off = tiled_offsets(rows_s, step * 8 + bytes_s, stride_sn, N, GATED, TILE // 8)
    async_copy.async_copy_global_to_shared(scales.index(slot), s_base + s_off)


@gluon.jit
def _wgmma_kernel(
    a_ptr, stride_am, w_ptr, s_ptr, d_ptr, out_ptr, stride_om,
    order_ptr, blk_expert_ptr, blk_start_ptr, blk_count_ptr, nblk_ptr, topw_ptr,
    N, TOPK, stride_we, stride_wn, stride_se, stride_sn, stride_de,
    K: gl.constexpr, GATED: gl.constexpr, BM: gl.constexpr, STAGES: gl.constexpr, PERMUTE_OUT: gl.constexpr,
    PDL: gl.constexpr, TILE: gl.constexpr = 0, BN: gl.constexpr = 64,
):  # fmt: skip
    """Program (row block b, weight rows n0 = BN * program_id(1); BN 64 or 128, a warpgroup per 64): GATED:
    silu(gate) * up of gate rows n0.. and up rows N + n0.. for the block's tokens (rows pair // TOPK of a, K in the
    kernel's order), stored per pair at columns n (PERMUTE_OUT: in the kernel's K order, for the down launch);
    else the down product of rows n0.. for the block's pair rows, times each pair's routing weight. K % 256 == 0
    (whole steps, 16-byte aligned scale rows), N % BN == 0 (gate/up with PERMUTE_OUT: N % 128, whole chunks of
    down's K)."""
    W: gl.constexpr = BN // 16  # warps: a warpgroup per 64 rows
    MMA: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[W, 1], instr_shape=[16, BM, 16]
    )
    SA: gl.constexpr = gl.DotOperandLayout(0, MMA, 2)  # weights [BN, 128], logical K order
    CODE: gl.constexpr = _code_layout(gl.to_linear_layout(SA, [BN, CHUNK]))  # code bytes [BN, 64]
    S3: gl.constexpr = _scale_layout(CODE)
    SS: gl.constexpr = gl.SliceLayout(2, S3)  # scale bytes [BN, 8]
    # activations [BM, 128]: 16 bytes a copy, 4 lanes along 64 contiguous bytes of a row, so a thread copies
    # 4 chunks of each of BM / 32 rows (few row addresses to hold)
    ACT: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [W, 1], [1, 0])
    SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, CHUNK], gl.bfloat16)
    R: gl.constexpr = 2 * BN if GATED else BN  # weight rows of a program
    CW: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [W, 1], [1, 0])  # code bytes [R, 64], 16 B a copy
    CSL: gl.constexpr = gl.BlockedLayout([1, 4], [16, 2], [W, 1], [1, 0])  # scale bytes [R, 8], 4 B a copy
    PLAIN: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    EPI: gl.constexpr = gl.BlockedLayout([4, 1], [16, 2], [1, W], [0, 1])  # outputs [BN, BM], 4 columns each
    STEPS: gl.constexpr = K // CHUNK

    pdl_wait(PDL)
    b = gl.program_id(0)
    n0 = gl.program_id(1) * BN
    if b >= gl.load(nblk_ptr):
        return
    e = gl.load(blk_expert_ptr + b).to(gl.int64)
    start = gl.load(blk_start_ptr + b)
    count = gl.load(blk_count_ptr + b)

    # each step's activations [BM, 128] (rows of the block's pairs; gate/up: token rows pair // TOPK), code
    # bytes [R, 64] and scale bytes [R, 8] of the program's R weight rows (gate/up: 64 gate rows, then their up
    # rows) go to shared memory by cp.async, into rings of STAGES steps
    ma = gl.arange(0, BM, layout=gl.SliceLayout(1, ACT))
    ka = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, ACT))
    pairs_a = gl.load(order_ptr + start + ma, mask=ma < count, other=0)  # rows past the block read row 0
    a_ptrs = a_ptr + (pairs_a // TOPK).to(gl.int64)[:, None] * stride_am + ka[None, :]
    rw = gl.arange(0, R, layout=gl.SliceLayout(1, CW))
    rows_w = n0 + rw % BN + (rw // BN) * N  # gate/up: the gate rows, then the same up rows
    bytes_w = gl.arange(0, 64, layout=gl.SliceLayout(0, CW))
    rs = gl.arange(0, R, layout=gl.SliceLayout(1, CSL))
    rows_s = n0 + rs % BN + (rs // BN) * N
    bytes_s = gl.arange(0, 8, layout=gl.SliceLayout(0, CSL))
    w_base = w_ptr + e * stride_we
    s_base = s_ptr + e * stride_se
    acts = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, CHUNK], SMEM)
    codes = gl.allocate_shared_memory(gl.uint8, [STAGES, R, 64], PLAIN)
    scales = gl.allocate_shared_memory(gl.uint8, [STAGES, R, 8], PLAIN)
    for i in gl.static_range(STAGES - 1):
        if i < STEPS:
            _copy_step(acts, codes, scales, i, i, a_ptrs, w_base, s_base, rows_w, bytes_w, rows_s, bytes_s,
                       stride_wn, stride_sn, N, GATED, TILE)  # fmt: skip
        async_copy.commit_group()

    acc = gl.zeros([BN, BM], gl.float32, layout=MMA)
    acc_up = gl.zeros([BN, BM], gl.float32, layout=MMA)
    for i in range(STEPS):
        slot = i % STAGES
        async_copy.wait_group(STAGES - 2)  # step i's copies landed (this thread's) ...
        gl.thread_barrier()  # ... and every thread's
        fence_async_shared()  # visible to wgmma's reads (the async proxy)
        b_t = acts.index(slot).permute((1, 0))  # [128, BM]
        cw = codes.index(slot).slice(0, BN).load(CODE)
        cs = scales.index(slot).slice(0, BN).load(SS)
        acc = warpgroup_mma(_weights(cw, cs, CODE, S3, SA), b_t, acc, is_async=True)
        if GATED:
            cw = codes.index(slot).slice(BN, BN).load(CODE)
            cs = scales.index(slot).slice(BN, BN).load(SS)
            acc_up = warpgroup_mma(_weights(cw, cs, CODE, S3, SA), b_t, acc_up, is_async=True)
            # step i - 1's MMAs done (this step's may run on): its slots are free
            acc, acc_up = warpgroup_mma_wait(2, deps=[acc, acc_up])
        else:
            acc = warpgroup_mma_wait(1, deps=[acc])
        refill = i + STAGES - 1  # into the slot step i - 1 read
        if refill < STEPS:
            _copy_step(acts, codes, scales, refill % STAGES, refill, a_ptrs, w_base, s_base, rows_w, bytes_w,
                       rows_s, bytes_s, stride_wn, stride_sn, N, GATED, TILE)  # fmt: skip
        async_copy.commit_group()
    if GATED:
        acc, acc_up = warpgroup_mma_wait(0, deps=[acc, acc_up])
    else:
        acc = warpgroup_mma_wait(0, deps=[acc])
    async_copy.wait_group(0)

    # epilogue: [BN rows, BM pairs], columns in EPI (4 rows a thread: 8 contiguous output bytes)
    mo = gl.arange(0, BM, layout=gl.SliceLayout(0, EPI))
    live = mo < count
    pairs = gl.load(order_ptr + start + mo, mask=live, other=0)
    ro = gl.arange(0, BN, layout=gl.SliceLayout(1, EPI))
    d0 = gl.load(d_ptr + e * stride_de)
    if GATED:
        d1 = gl.load(d_ptr + e * stride_de + 1)
        gate = round_bf16(acc * 256.0 * d0)  # the bf16-bit dequantization leaves a factor 2^-8
        up = round_bf16(acc_up * 256.0 * d1)
        y = round_bf16(round_bf16(gate / (1.0 + gl.exp(-gate))) * up)
        if PERMUTE_OUT and BN == 128:  # a whole chunk: rows n0 + (c, j, q, t, h) -> (j, h, q, c, t)
            y = gl.reshape(gl.permute(gl.reshape(y, [4, 4, 2, 2, 2, BM]), Y_ORDER.value), [BN, BM])
            col = n0 + ro
        elif PERMUTE_OUT:  # rows n0 + (c0, j, q, t, h) -> (j, h, q, c0, t): the down launch's K order
            y = gl.reshape(gl.permute(gl.reshape(y, [2, 4, 2, 2, 2, BM]), Y_ORDER.value), [BN, BM])
            col = _out_columns(n0, ro)
        else:
            col = n0 + ro
    else:
        topw = round_bf16(gl.load(topw_ptr + pairs, mask=live, other=0.0))
        y = round_bf16(acc * 256.0 * d0)
        col = n0 + ro
    y = gl.convert_layout(y, EPI)
    if not GATED:
        y = y * topw[None, :]
    out_ptrs = out_ptr + pairs.to(gl.int64)[None, :] * stride_om + col[:, None]
    gl.store(out_ptrs, y.to(gl.bfloat16), mask=(ro[:, None] >= 0) & live[None, :])


# ---- launchers --------------------------------------------------------------------------------------


def fits(hidden: int, inter: int, tile: int) -> bool:
    """Whether the kernel takes experts of this shape and byte order: both K multiples of 256 (whole 128-wide
    steps, and rows of block scales whose 16-byte alignment the compiler sees: the 4-byte cp.async of a row's
    scales needs it), row-major or tiled at 64-byte steps."""
    return hidden % 256 == 0 and inter % 256 == 0 and tile in (0, 64)


def stages_for(bm: int, gated: bool, rows: int = ROWS) -> int:
    """Ring depth (2-4 steps) within the shared memory that keeps two programs of 64 rows on an SM (113 KB each of
    228), or one of 128 rows (220 KB): a step holds bm x 128 activations (2 bytes) and each weight row's 64 code
    and 8 scale bytes (gate/up: twice the rows) -- 41 KB at 128 pairs and 64 gate/up rows, 2 steps; 50 KB at 128
    rows, 4 steps."""
    per_step = bm * STEP_K * 2 + rows * (2 if gated else 1) * 72
    budget = (113 if rows == ROWS else 220) * 1024
    return max(2, min(4, budget // per_step))


def _launch(a, w, s, decode, out, routing: Routing, topw, n, k, top_k, gated, permute_out, tile, stages,
            rows=ROWS):  # fmt: skip
    if rows not in (64, 128):
        raise ValueError(f"rows = {rows}: a program takes 64 or 128 weight rows")
    stages = stages or stages_for(routing.bm, gated, rows)
    if stages < 2:
        raise ValueError(f"stages = {stages}: the ring needs at least 2")
    if k % 256:
        raise ValueError(
            f"K = {k} is not a multiple of 256 (whole {STEP_K}-wide steps, 16-byte aligned scale rows)"
        )
    whole = STEP_K if gated and permute_out else rows
    if n % whole:
        raise ValueError(
            f"N = {n} is not a multiple of {whole}"
            + (
                " (the output in the down launch's K order: whole 128-wide chunks)"
                if gated and permute_out
                else ""
            )
        )
    if tile not in (0, 64):
        raise ValueError(f"experts tiled at {tile}-byte steps: this kernel reads row-major or 64-byte steps")
    if routing.bm not in (64, 128):
        raise ValueError(f"row blocks of {routing.bm} pairs: this kernel takes 64 or 128")
    _wgmma_kernel[(routing.blk_expert.numel(), n // rows)](
        a, a.stride(0), w, s, decode, out, out.stride(0), routing.order, routing.blk_expert, routing.blk_start,
        routing.blk_count, routing.nblk, topw, n, top_k, w.stride(0), w.stride(1), s.stride(0), s.stride(1),
        decode.stride(0), K=k, GATED=gated, BM=routing.bm, STAGES=stages, PERMUTE_OUT=permute_out, TILE=tile,
        BN=rows, num_warps=rows // 16, **pdl_args(),
    )  # fmt: skip
    return out


def wgmma_gate_up(x_perm, packed, scales, decode, routing: Routing, top_k: int, out=None, tile: int = 0,
                  permute_out: bool = True, stages: int = 0, rows: int = ROWS):  # fmt: skip
    """x_perm [T, H] bf16 in the kernel's K order (``permute_k``); packed [E, 2I, H/2] NVFP4 -> silu(gate) * up
    per pair [T*k, I] bf16 (row = pair), in the kernel's K order when ``permute_out`` (``wgmma_down``'s input).
    ``stages`` 0: ``stages_for``; ``rows``: weight rows a program (64: one warpgroup, 128: two)."""
    two_i, hidden = packed.shape[1], x_perm.shape[1]
    if out is None:
        out = torch.empty(x_perm.shape[0] * top_k, two_i // 2, dtype=x_perm.dtype, device=x_perm.device)
    s = scales.view(torch.uint8)
    return _launch(x_perm, packed, s, decode, out, routing, decode, two_i // 2, hidden, top_k, True,
                   permute_out, tile, stages, rows)  # fmt: skip


def wgmma_down(act_perm, packed, scales, decode, routing: Routing, topk_weights, out=None, tile: int = 0,
               stages: int = 0, rows: int = ROWS):  # fmt: skip
    """act_perm [T*k, I] bf16 in the kernel's K order (``wgmma_gate_up``'s); packed [E, H, I/2] -> weight *
    down(act) per pair [T*k, H] bf16."""
    hidden, inter = packed.shape[1], act_perm.shape[1]
    if out is None:
        out = torch.empty(act_perm.shape[0], hidden, dtype=torch.bfloat16, device=act_perm.device)
    s = scales.view(torch.uint8)
    topw = topk_weights.reshape(-1).float()
    return _launch(act_perm, packed, s, decode, out, routing, topw, hidden, inter, 1, False, False, tile, stages,
                   rows)  # fmt: skip


def moe_pairs(x, gu, dn, routing: Routing, top_k: int, topk_weights, tile: int = 0, x_k=None):
    """Each (token, expert) pair's weighted output [T*k, H] bf16 through both launches (gate/up writes down's
    input in the kernel's K order). ``x_k``: x already in the K order (the post-attention norm writes it),
    else ``permute_k(x)``."""
    act = wgmma_gate_up(permute_k(x) if x_k is None else x_k, *gu, routing, top_k, tile=tile)
    return wgmma_down(act, *dn, routing, topk_weights, tile=tile)
