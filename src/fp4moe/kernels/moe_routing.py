"""Routing for the grouped expert kernels: the (token, expert) pairs of a step sorted by expert, and a block
table (one entry per run of up to BM pairs of one expert: which expert, where its pairs start, how many).
``align`` builds it in one Triton program for decode-sized steps and in two launches for prefill-sized ones
(``align_chunked``: chunks sorted apart, then placed); ``pair_routing`` makes every pair its own block for a few tokens (nothing sorted). Every table has a
static shape (``max_blocks``), so the steps that use them can be captured in CUDA graphs. Reference:
``align_reference`` (the tests compare ``align`` with it)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4moe.kernels import next_pow2, not_capturing, pdl_args
from fp4moe.kernels.tl_helpers import wait_for_previous


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
    then the block table (``_block_table``)."""
    wait_for_previous(PDL)
    offs = tl.arange(0, TKP)
    live = offs < TK
    ids = tl.load(ids_ptr + offs, mask=live, other=E)  # padding sorts after every expert
    keys = tl.sort(ids * TKP + offs)
    tl.store(order_ptr + offs, keys % TKP, mask=live)
    counts = tl.histogram(ids, E, mask=live)
    _block_table(counts, blk_expert_ptr, blk_start_ptr, blk_count_ptr, nblk_ptr, E, BM)


@triton.jit
def _block_table(counts, blk_expert_ptr, blk_start_ptr, blk_count_ptr, nblk_ptr, E: tl.constexpr,
                 BM: tl.constexpr):  # fmt: skip
    """The block table of pairs sorted by expert, ``counts`` [E] per expert: one entry per BM pairs of an
    expert (expert, first pair, pairs), written expert by expert, and their number. Entries past it are left
    as they were (the expert kernels stop there)."""
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


@triton.jit(do_not_specialize=["TK"])
def _chunk_sort_kernel(ids_ptr, TK, sorted_ptr, counts_ptr, E: tl.constexpr, CH: tl.constexpr,
                       PDL: tl.constexpr):  # fmt: skip
    """Program c: chunk c's pairs (CH of them) sorted by (expert, pair index) -- keys expert * CH + the
    pair's place in the chunk, to ``sorted_ptr`` -- and its count of pairs per expert [E] to ``counts_ptr``
    row c."""
    wait_for_previous(PDL)
    c = tl.program_id(0)
    offs = tl.arange(0, CH)
    live = c * CH + offs < TK
    ids = tl.load(ids_ptr + c * CH + offs, mask=live, other=E)  # padding sorts after every expert
    tl.store(sorted_ptr + c * CH + offs, tl.sort(ids * CH + offs), mask=live)
    tl.store(counts_ptr + c * E + tl.arange(0, E), tl.histogram(ids, E, mask=live))


@triton.jit(do_not_specialize=["TK", "NCH"])
def _chunk_place_kernel(
    TK, sorted_ptr, counts_ptr, base_ptr, order_ptr, blk_expert_ptr, blk_start_ptr, blk_count_ptr, nblk_ptr,
    NCH, E: tl.constexpr, CH: tl.constexpr, BM: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program c: each of chunk c's sorted pairs to its place in the whole order -- its expert's start, plus
    that expert's pairs in earlier chunks, plus its rank among the expert's pairs in this chunk (stable: the
    single-program sort's order). Program 0 also writes the block table, as ``_align_kernel`` does."""
    wait_for_previous(PDL)
    c = tl.program_id(0)
    experts = tl.arange(0, E)
    counts = tl.zeros((E,), dtype=tl.int32)  # pairs per expert
    before = tl.zeros((E,), dtype=tl.int32)  # the expert's pairs in chunks before c
    for other in range(0, NCH):
        n = tl.load(counts_ptr + other * E + experts)
        counts += n
        before += tl.where(other < c, n, 0)
    starts = tl.cumsum(counts, 0) - counts
    mine = tl.load(counts_ptr + c * E + experts)
    local = tl.cumsum(mine, 0) - mine  # where the expert's run starts in this chunk's sorted pairs
    # where sorted position i of this chunk goes: base[expert] + i
    tl.store(base_ptr + c * E + experts, starts + before - local)
    tl.debug_barrier()
    offs = tl.arange(0, CH)
    live = c * CH + offs < TK
    key = tl.load(sorted_ptr + c * CH + offs, mask=live, other=0)
    dest = tl.load(base_ptr + c * E + key // CH, mask=live, other=0) + offs
    tl.store(order_ptr + dest, c * CH + key % CH, mask=live)
    if c == 0:
        _block_table(counts, blk_expert_ptr, blk_start_ptr, blk_count_ptr, nblk_ptr, E, BM)


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
    """topk_ids [T, k] -> Routing. One program (of ``num_warps``) for up to ``ALIGN_MAX_PAIRS`` pairs (decode,
    speculative verification, small prefill chunks); ``align_chunked`` otherwise."""
    tk = topk_ids.numel()
    if tk > ALIGN_MAX_PAIRS:
        return align_chunked(topk_ids, num_experts, bm)
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
# pairs a program of the two-launch align sorts: 1,024, so an 8K prompt's 65,536 pairs take 64 programs (4,096
# in 16 took 72 us a layer on the H200: a bitonic sort's stages grow with log^2 of its length)
ALIGN_CHUNK = 1024


def align_chunked(topk_ids: torch.Tensor, num_experts: int, bm: int, chunk: int = ALIGN_CHUNK) -> Routing:
    """``align`` for prefill-sized steps in two launches: each chunk of ``chunk`` pairs sorted in its own
    program, then every pair placed (where ``align_reference``'s torch sort, scatter, cumsum and search took
    ~20 launches: an 8K prefill on the H200 spent ~4 ms in them over 40 layers). The same tables."""
    tk = topk_ids.numel()
    maxb = max_blocks(tk, num_experts, bm)
    dev = topk_ids.device
    e = next_pow2(num_experts)
    nch = triton.cdiv(tk, chunk)
    flat = topk_ids.reshape(-1).to(torch.int32)
    tk4 = -(-tk // 4) * 4  # (the scratch's parts on 16 bytes where next_pow2(experts) is too: one variant)
    scratch = torch.empty(tk4 + 2 * nch * e, dtype=torch.int32, device=dev)  # sorted chunks, counts, bases
    sorted_, counts, base = scratch.split([tk4, nch * e, nch * e])
    order = torch.empty(tk, dtype=torch.int32, device=dev)
    blk = torch.empty(3, -(-maxb // 4) * 4, dtype=torch.int32, device=dev)[:, :maxb]  # (16-byte rows: align)
    nblk = torch.empty(1, dtype=torch.int32, device=dev)
    _chunk_sort_kernel[(nch,)](flat, tk, sorted_, counts, E=e, CH=chunk, num_warps=4, **pdl_args())
    _chunk_place_kernel[(nch,)](
        tk, sorted_, counts, base, order, blk[0], blk[1], blk[2], nblk, nch,
        E=e, CH=chunk, BM=bm, num_warps=4, **pdl_args(),
    )  # fmt: skip
    return Routing(order, blk[0], blk[1], blk[2], nblk, bm)


PAIR_ROUTING_MAX_TOKENS = 4  # up to this many tokens, every pair is its own row block (no sort)
_PAIR_TABLES: dict[tuple[int, torch.device], tuple[torch.Tensor, ...]] = {}


def pair_routing(topk_ids: torch.Tensor, bm: int) -> Routing:
    """Routing with one row block per (token, expert) pair, in pair order: the block table is the router's
    own output, so nothing is sorted -- for a few tokens, where an align launch costs more than reading an
    expert twice when two tokens share it. The constant tables are made once per size and device (in the
    warm-up before a graph capture)."""
    tk, dev = topk_ids.numel(), topk_ids.device
    if (tk, dev) not in _PAIR_TABLES:
        not_capturing(dev, "pair_routing's tables")
        rows = torch.arange(tk, dtype=torch.int32, device=dev)
        _PAIR_TABLES[(tk, dev)] = (
            rows, torch.ones(tk, dtype=torch.int32, device=dev), torch.full((1,), tk, dtype=torch.int32, device=dev)
        )  # fmt: skip
    rows, ones, nblk = _PAIR_TABLES[(tk, dev)]
    return Routing(rows, topk_ids.reshape(-1).to(torch.int32), rows, ones, nblk, bm)


def align_reference(topk_ids: torch.Tensor, num_experts: int, bm: int) -> Routing:
    """The same tables with torch ops (the tests' reference)."""
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
