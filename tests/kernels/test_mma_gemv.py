"""The tensor-core expert GEMVs (``kernels.nvfp4_mma_gemv``, Gluon: GPU only, no interpreter) against the
dequantized reference and against the CUDA-core GEMV they stand in for. Tolerances as in kernel_refs.py
(relative L2 2e-2 against the float64 reference: the same bf16 roundings of gate, up, silu and the weighted
output; another fp32 summation order), and the activations within a bf16 ulp of the CUDA-core GEMV's (1e-2)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_refs import BF16, DEV, RTOL, rel  # noqa: E402
from test_gemv import _experts  # noqa: E402

from fp4moe.kernels import moe_dispatch as dispatch  # noqa: E402
from fp4moe.kernels import moe_router  # noqa: E402
from fp4moe.kernels import moe_routing as mr  # noqa: E402
from fp4moe.kernels import nvfp4_gemm as gemm  # noqa: E402


def _mma():
    if DEV.type != "cuda" or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("the Gluon kernel needs an NVIDIA GPU (sm89+: fp8 scales); there is no interpreter")
    from fp4moe.kernels import nvfp4_mma_gemv as mma

    return mma


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("tokens", "blocks"),
    [(1, "pairs"), (3, "pairs"), (3, "align"), (16, "align"), (40, "align")],
)
@pytest.mark.parametrize(
    ("gu_tiles", "dn_tiles"), [((4, 32), (2, 32, 16)), ((1, 64), (1, 32, 32)), ((1, 32), (4, 128, 16))]
)
def test_mma_gemv_matches_the_reference(tokens, blocks, gu_tiles, dn_tiles):
    mma = _mma()
    gen = torch.Generator().manual_seed(300 + tokens)
    # H = 256, I = 128 (K: 128 and 64 bytes a row): one, two or four K steps per program
    (gp, gs, gd), (dp, ds, dd) = _experts(gen, e=8, h=256, i=128)
    gp, gs, gd, dp, ds, dd = (t.to(DEV) for t in (gp, gs, gd, dp, ds, dd))
    k, h = 3, gp.shape[-1] * 2
    x = torch.randn(tokens, h, generator=gen).to(BF16).to(DEV)
    ids, w = moe_router.router_reference(torch.randn(tokens, gp.shape[0], generator=gen).to(DEV), k)
    ids = ids.int().contiguous()
    # with 8 experts and 40 tokens, blocks of 8 pairs: several blocks per expert, some partly filled
    routing = mr.pair_routing(ids, 1) if blocks == "pairs" else mr.align(ids, gp.shape[0], mma.TOKENS)
    poison = torch.full((tokens * k, gp.shape[1] // 2), float("nan"), dtype=BF16, device=DEV)
    act = mma.mma_gate_up(x, gp, gs, gd, routing, k, out=poison, tiles=mma.MmaTiles(*gu_tiles))
    out = mma.mma_down(act, dp, ds, dd, routing, w, tiles=mma.MmaTiles(*dn_tiles))
    assert torch.isfinite(act).all() and torch.isfinite(out).all()  # every pair row written
    ref = gemm.moe_reference(x.double(), gp, gs, gd.double(), dp, ds, dd.double(), ids, w.double())
    assert rel(out.view(tokens, k, h).sum(1, dtype=torch.float32), ref) < RTOL
    from fp4moe.kernels import nvfp4_gemv as gemv

    assert rel(act, gemv.gemv_gate_up(x, gp, gs, gd, ids)) < 1e-2
    assert rel(out, gemv.gemv_down(act, dp, ds, dd, ids, w)) < 1e-2


@pytest.mark.gpu
def test_mma_gemv_refuses_what_it_cannot_tile():
    mma = _mma()
    gen = torch.Generator().manual_seed(7)
    ids = torch.tensor([[0, 1]], dtype=torch.int32, device=DEV)
    for h, routing, match in (
        (96, mr.pair_routing(ids, 1), "multiple of 64"),
        (128, mr.align(ids, 4, 16), "at most"),
    ):
        (gp, gs, gd), _ = _experts(gen, e=4, h=h, i=32)
        x = torch.randn(1, h).to(BF16).to(DEV)
        with pytest.raises(ValueError, match=match):
            mma.mma_gate_up(x, gp.to(DEV), gs.to(DEV), gd.to(DEV), routing, 2)


@pytest.mark.parametrize(
    ("k", "tiles", "fitted"),
    [
        (2048, (4, 32), (4, 32)),  # gate/up: 8 steps of 128 bytes a row
        (512, (2, 64), (2, 64)),  # down at batch 1: 2 steps
        (64, (4, 32), (1, 32)),  # the decode gate's tiny model: 32 bytes a row, one warp
        (192, (4, 64), (1, 32)),  # 96 bytes: 3 steps of 32
        (256, (8, 128), (4, 32)),
    ],
)
def test_tiles_fit_any_k_of_64(k, tiles, fitted):
    from fp4moe.kernels import nvfp4_mma_gemv as mma

    t = mma.MmaTiles(*tiles).for_k(k)
    assert (t.wk, t.kc) == fitted and (k // 2) % (t.wk * t.kc) == 0
    with pytest.raises(ValueError, match="multiple of 64"):
        mma.MmaTiles(*tiles).for_k(k + 32)
    with pytest.raises(ValueError, match="16 or 32"):
        mma.MmaTiles(2, 32, rows=64)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 3, 16, 130])
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_moe_pairs_dispatch(tokens, ids_dtype, monkeypatch):
    """The engine's entry (``moe_pairs``) at each token count: up to 4 tokens the CUDA-core gate/up and, with
    the router's int32 ids, the tensor-core down over pairs (other ids: the CUDA-core down, since the down
    programs read the ids before their wait); 5-128 tokens the tensor-core GEMVs over blocks of 8; 130 the
    grouped GEMM. Every path against the float64 reference."""
    mma = _mma()
    from fp4moe.kernels import nvfp4_gemv as gemv

    gen = torch.Generator().manual_seed(400 + tokens)
    (gp, gs, gd), (dp, ds, dd) = _experts(gen, e=8, h=128, i=64)
    experts = dispatch.ExpertWeights(
        (gp.to(DEV), gs.to(DEV), gd.to(DEV)), (dp.to(DEV), ds.to(DEV), dd.to(DEV))
    )
    k, h = 3, 128
    x = torch.randn(tokens, h, generator=gen).to(BF16).to(DEV)
    ids, w = moe_router.router_reference(torch.randn(tokens, 8, generator=gen).to(DEV), k)
    ids = ids.to(ids_dtype).contiguous()
    calls = []

    def spy(module, name):
        fn = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, **kw: calls.append(name) or fn(*a, **kw))

    spy(mma, "mma_down")  # (moe_pairs calls them through their modules)
    spy(gemv, "gemv_down")
    spy(gemm, "moe_down")
    out = dispatch.moe_pairs(experts, x, ids, w.float())
    expected = (
        ("mma_down" if ids_dtype == torch.int32 else "gemv_down")
        if tokens <= dispatch.GEMV_MAX_TOKENS
        else "mma_down"
        if tokens <= dispatch.MMA_GEMV_MAX_TOKENS
        else "moe_down"
    )
    assert calls == [expected]
    ref = gemm.moe_reference(x.double(), gp, gs, gd.double(), dp, ds, dd.double(), ids, w.double())
    assert rel(out.view(tokens, k, h).sum(1, dtype=torch.float32), ref) < RTOL
