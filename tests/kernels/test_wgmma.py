"""The Hopper prefill expert GEMMs (``kernels.nvfp4_wgmma``). On the CPU: the reorders the kernel spells with
``k_order``'s constants
(``SPLIT``, ``W_ORDER`` on a step's dequantized nibbles, ``Y_ORDER`` and ``_out_columns``' arithmetic on the
gate/up epilogue's rows) land every weight and output where ``permute_k`` puts its activation. The kernels
themselves are Gluon (no interpreter): they run on an sm90 GPU only, against the dequantized reference and the
weights-first Triton kernel, with the tolerance of kernel_refs.py (the same bf16 roundings; another fp32
summation order and sigmoid formula)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_refs import BF16, DEV, RTOL, rel  # noqa: E402

from fp4moe.kernels import k_order as ko  # noqa: E402
from fp4moe.kernels import nvfp4_wgmma as wg  # noqa: E402


def test_a_steps_weights_reach_the_mma_in_the_k_order():
    """``_weights``: code byte b = 16 c + 4 j + 2 q + t of a row holds k = 2b (low nibble) and 2b + 1 (high);
    joined as [rows, 64, 2], split as SPLIT and reordered by W_ORDER, logical position kappa must hold weight
    k_order(128)[kappa] -- the column of the activations ``permute_k`` puts there."""
    w = torch.randn(64, 128)  # one step's dequantized weights, physical k
    joined = torch.stack([w[:, 0::2], w[:, 1::2]], dim=-1)  # [rows, byte, nibble]
    logical = joined.reshape(64, *ko.SPLIT).permute(*wg.W_ORDER.value).reshape(64, 128)
    assert torch.equal(logical, w[:, ko.k_order(128)])
    x = torch.randn(3, 128)
    assert torch.allclose(ko.permute_k(x) @ logical.T, x @ w.T, atol=1e-5)


@pytest.mark.parametrize("n0", [0, 64, 128, 448])
def test_gate_up_writes_its_rows_where_down_reads_them(n0):
    """The gate/up epilogue's program rows n0 .. n0 + 63 (the down launch's K), split (c0, j, q, t, h) and
    reordered by Y_ORDER, stored at ``_out_columns`` (its arithmetic, mirrored): the row of physical column n
    must land at the column ``permute_k`` gives n."""
    rows = (n0 + torch.arange(64)).float()[:, None]  # each row's physical column as its value
    lam = torch.arange(64)
    reordered = rows.reshape(2, 4, 2, 2, 2, 1).permute(*wg.Y_ORDER.value).reshape(64)
    cols = (n0 // 128) * 128 + ((lam >> 2) << 3) + (((n0 >> 6) & 1) << 2) + (lam & 3)  # _out_columns
    where = ko.permute_k(torch.arange(n0 // 128 * 128 + 128).float()[None])[0]
    assert torch.equal(where[cols], reordered)


def _wgmma():
    if DEV.type != "cuda" or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma is Hopper's (sm90); Gluon has no interpreter")
    return wg


def _setup(tokens, h, i, tile, seed=0):
    from test_expert_layout import _tiled
    from test_gemv import _experts

    from fp4moe.kernels import moe_router

    gen = torch.Generator().manual_seed(900 + tokens + seed)
    gu, dn = _experts(gen, e=8, h=h, i=i)
    x = torch.randn(tokens, h, generator=gen).to(BF16).to(DEV)
    ids, w = moe_router.router_reference(torch.randn(tokens, 8, generator=gen).to(DEV), 3)
    tgu, tdn = _tiled(gu, dn, tile) if tile else (gu, dn)
    return gu, dn, tgu, tdn, x, ids.int().contiguous(), w.float()


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [0, 64])
@pytest.mark.parametrize(
    ("tokens", "bm", "stages", "h", "i", "rows"),
    [(300, 64, 0, 256, 256, 64), (300, 128, 0, 256, 256, 64), (700, 128, 3, 256, 256, 64),
     (90, 64, 2, 256, 256, 64), (300, 128, 0, 1024, 1024, 64), (300, 64, 0, 1024, 1024, 64),
     (300, 128, 3, 1024, 512, 64), (300, 128, 0, 1024, 1024, 128), (90, 64, 0, 256, 256, 128)],
)  # fmt: skip
def test_wgmma_experts_match_the_reference(tokens, bm, stages, h, i, rows, tile):
    """Both launches against the dequantized reference and the weights-first Triton kernel on the same blocks:
    partial blocks (counts under ``bm``), two to four ring stages -- with 8 K steps the ring wraps around, every
    slot refilled while another step's MMAs run -- both byte orders, one and two warpgroups a program (``rows``
    64, 128); gate/up's output is down's input in the K order (and in the natural order without
    ``permute_out``)."""
    _wgmma()
    from fp4moe.kernels import moe_routing as mr
    from fp4moe.kernels import nvfp4_dequant as dq
    from fp4moe.kernels import nvfp4_gemm as gemm

    if dq.DEQUANT_MODE != 7:
        pytest.skip("the kernel dequantizes as mode 7")
    k = 3
    gu, dn, tgu, tdn, x, ids, w = _setup(tokens, h, i, tile)
    routing = mr.align(ids, 8, bm)
    act = wg.wgmma_gate_up(ko.permute_k(x), *tgu, routing, k, tile=tile, stages=stages, rows=rows)
    plain = wg.wgmma_gate_up(
        ko.permute_k(x), *tgu, routing, k, tile=tile, stages=stages, permute_out=False, rows=rows
    )
    assert torch.equal(ko.unpermute_k(act), plain)
    ref_act = gemm.moe_gate_up(x, *gu, routing, k)
    assert rel(plain, ref_act) < RTOL
    pairs = wg.wgmma_down(act, *tdn, routing, w, tile=tile, stages=stages, rows=rows)
    assert rel(pairs, gemm.moe_down(ref_act, *dn, routing, w)) < RTOL
    out = pairs.view(tokens, k, h).sum(1, dtype=torch.float32)
    ref = gemm.moe_reference(x.double(), *gu[:2], gu[2].double(), *dn[:2], dn[2].double(), ids, w.double())
    assert rel(out, ref) < RTOL


@pytest.mark.gpu
def test_dispatch_runs_prefill_blocks_through_wgmma_when_switched_on(monkeypatch):
    """``moe_dispatch.WGMMA_PREFILL``: a prefill's pairs go through ``nvfp4_wgmma.moe_pairs`` (counted) and give
    the default path's outputs within the tolerance; given the input in the K order, exactly the same."""
    _wgmma()
    from fp4moe.kernels import moe_dispatch as dispatch

    gu, dn, _, _, x, ids, w = _setup(1200, 256, 256, 0)
    experts = dispatch.ExpertWeights(gu, dn)
    default = dispatch.moe_pairs(experts, x, ids, w)
    calls = []
    real = wg.moe_pairs
    monkeypatch.setattr(wg, "moe_pairs", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(dispatch, "WGMMA_PREFILL", True)
    got = dispatch.moe_pairs(experts, x, ids, w)
    assert calls == [1] and dispatch.wants_k_order(experts, x, 3)
    assert rel(got, default) < RTOL
    # the input already in the K order (as the post-attention norm writes it): the same outputs
    assert torch.equal(dispatch.moe_pairs(experts, x, ids, w, ko.permute_k(x)), got)


def test_launch_refuses_what_it_cannot_tile():
    from fp4moe.kernels.moe_routing import Routing

    t = torch.zeros(1, dtype=torch.int32)
    r = Routing(t, t, t, t, t, 16)
    with pytest.raises(ValueError, match="64 or 128"):
        wg._launch(None, None, None, None, None, r, None, 128, 256, 1, True, True, 0, 0)
    with pytest.raises(ValueError, match="multiple of 256"):
        wg._launch(None, None, None, None, None, r, None, 64, 384, 1, True, True, 0, 0)
    with pytest.raises(ValueError, match="whole 128-wide chunks"):  # the K-order output of I = 192
        wg._launch(None, None, None, None, None, r, None, 192, 256, 1, True, True, 0, 0)
    with pytest.raises(ValueError, match="64 or 128 weight rows"):
        wg._launch(None, None, None, None, None, r, None, 128, 256, 1, True, True, 0, 0, 32)
    with pytest.raises(ValueError, match="64-byte steps"):
        wg._launch(None, None, None, None, None, r, None, 128, 256, 1, True, True, 32, 0)
    assert wg.fits(2048, 512, 64) and not wg.fits(2048, 128, 64) and not wg.fits(2048, 512, 32)


@pytest.mark.parametrize("n0", [0, 384])
def test_two_warpgroups_write_a_whole_chunk_in_the_k_order(n0):
    """128 rows a program (``rows=128``): split (c, j, q, t, h) and reordered by Y_ORDER, row lam of the result
    is column n0 + lam -- the chunk exactly as ``permute_k`` orders it."""
    rows = (n0 + torch.arange(128)).float()[:, None]
    reordered = rows.reshape(4, 4, 2, 2, 2, 1).permute(*wg.Y_ORDER.value).reshape(128)
    assert torch.equal(reordered, n0 + ko.k_order(128).float())
