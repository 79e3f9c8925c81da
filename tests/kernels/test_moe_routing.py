"""MoE routing tables (``kernels/moe_routing.py``): the align kernel against torch sorting (``align_reference``),
exactly (integer outputs), and its tables' alignment. On CUDA when there is one, else under Triton's
interpreter."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from fp4moe.kernels import moe_routing as mr  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize(
    "tokens,experts,top_k", [(1, 16, 4), (7, 16, 4), (40, 32, 8), (64, 256, 8), (512, 256, 8)]
)
def test_align_matches_torch_sorting(tokens, experts, top_k):
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    if tokens == 64:  # crowd a few experts: several row blocks each
        ids[:, 0], ids[: tokens // 2, 1] = 3, 200
    ids = ids.to(DEV)
    for bm in (16, 32):
        _same_tables(mr.align(ids, experts, bm), mr.align_reference(ids, experts, bm), tokens * top_k)


def _same_tables(a: mr.Routing, b: mr.Routing, pairs: int) -> None:
    n = int(b.nblk)
    assert int(a.nblk) == n
    assert torch.equal(a.order.cpu(), b.order.cpu())
    tables = zip(
        (a.blk_expert, a.blk_start, a.blk_count), (b.blk_expert, b.blk_start, b.blk_count), strict=True
    )
    for x, y in tables:
        assert torch.equal(x[:n].int().cpu(), y[:n].int().cpu())  # entries past nblk are never read
    covered = sorted(int(p) for blk in range(n) for p in a.order[a.blk_start[blk] :][: a.blk_count[blk]])
    assert covered == list(range(pairs))  # every pair exactly once


@pytest.mark.parametrize("tokens,experts,top_k", [(50, 16, 4), (70, 24, 3), (16, 16, 4), (600, 16, 4)])
def test_chunked_align_matches_torch_sorting(tokens, experts, top_k):
    """The two-launch align of prefill-sized steps (chunks sorted apart, then placed), here in 64-pair chunks:
    a ragged last chunk, an expert count that is no power of two, one whole chunk, and 38 chunks. Exactly the
    torch sort's stable order and tables."""
    gen = torch.Generator().manual_seed(tokens + experts)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    ids[: tokens // 2, 0] = 5  # a crowded expert: runs across chunks
    ids = ids.to(DEV)
    for bm in (16, 64):
        got = mr.align_chunked(ids, experts, bm, chunk=64)
        _same_tables(got, mr.align_reference(ids, experts, bm), tokens * top_k)


def test_align_takes_the_chunked_kernels_past_one_programs_pairs():
    """A step of more pairs than one program sorts (an 8,192-token prompt's 65,536 at top-8) goes through the
    chunked launches, with the reference's tables."""
    gen = torch.Generator().manual_seed(15)
    ids = torch.stack([torch.randperm(256, generator=gen)[:8] for _ in range(600)]).to(DEV)
    assert ids.numel() > mr.ALIGN_MAX_PAIRS
    _same_tables(mr.align(ids, 256, 128), mr.align_reference(ids, 256, 128), ids.numel())


def test_align_tables_are_16_byte_aligned_at_every_token_count():
    """Triton specializes kernels on each pointer's 16-byte alignment: block tables whose rows were
    misaligned for some token counts made new variants of the align and expert kernels, compiled while a
    server answered (issue 20). Every table row starts on 16 bytes, whatever the count."""
    gen = torch.Generator().manual_seed(14)
    for t in [1, 2, 3, 5, 6, 7, 9, 13]:
        ids = torch.randint(0, 16, (t, 4), generator=gen).to(DEV)
        r = mr.align(ids, 16, 16)
        assert all(x.data_ptr() % 16 == 0 for x in (r.order, r.blk_expert, r.blk_start, r.blk_count)), t
