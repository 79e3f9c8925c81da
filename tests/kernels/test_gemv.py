"""The decode expert GEMVs (``kernels.nvfp4_gemv``) against the dequantized reference and against the
grouped GEMM they stand in for. Tolerances as in kernel_refs.py (relative L2 2e-2: same bf16 roundings,
another fp32 summation order)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_refs import BF16, BF16_INTERPRETER, DEV, RTOL, quantized, rel  # noqa: E402

from fp4moe.kernels import moe_router  # noqa: E402
from fp4moe.kernels import moe_routing as mr  # noqa: E402
from fp4moe.kernels import nvfp4_dequant as dq  # noqa: E402
from fp4moe.kernels import nvfp4_gemm as gemm  # noqa: E402
from fp4moe.kernels import nvfp4_gemv as gemv  # noqa: E402


def _experts(gen, e=8, h=128, i=64):
    gp, gs, gd = quantized((e * 2, i, h), gen)
    gp, gs, gd = gp.view(e, 2 * i, h // 2), gs.view(e, 2 * i, h // 16), gd.view(e, 2).contiguous()
    dp, ds, dd = quantized((e, h, i), gen)
    return (gp, gs, gd), (dp, ds, dd)


@pytest.mark.parametrize("mode", [1, 4, 7])
@pytest.mark.parametrize("tokens", [1, 3])
def test_gemv_experts_match_the_dequantized_reference(tokens, mode, monkeypatch):
    if mode >= 4 and DEV.type != "cuda":
        pytest.skip(BF16_INTERPRETER)
    monkeypatch.setattr(dq, "DEQUANT_MODE", mode)
    gen = torch.Generator().manual_seed(200 + tokens)
    (gp, gs, gd), (dp, ds, dd) = _experts(gen)
    k, h = 3, gp.shape[-1] * 2
    x = torch.randn(tokens, h, generator=gen).to(BF16).to(DEV)
    ids, w = moe_router.router_reference(torch.randn(tokens, gp.shape[0], generator=gen).to(DEV), k)
    ids = ids.int()
    small = gemv.GemvTiles(16, 64, 4, 2)  # two K tiles per gate/up program (H = 128)
    act = gemv.gemv_gate_up(x, gp, gs, gd, ids, tiles=small)
    # two per down program too (I = 64): the first, loaded before the wait, and one in the loop
    out = gemv.gemv_down(act, dp, ds, dd, ids, w, tiles=gemv.GemvTiles(16, 32, 4, 2))
    one_tile = gemv.gemv_down(act, dp, ds, dd, ids, w, tiles=small)  # the first tile is all of K
    assert rel(one_tile, out) < 1e-2
    summed = gemv.GemvTiles(16, 64, 4, 2, sum_each=True)  # each K tile reduced at once: same sums, reordered
    assert rel(gemv.gemv_gate_up(x, gp, gs, gd, ids, tiles=summed), act) < 1e-2
    wide = gemv.GemvTiles(128, 64, 4, 2)  # 64 gate rows in a 128-row block: the rest masked off
    assert rel(gemv.gemv_gate_up(x, gp, gs, gd, ids, tiles=wide), act) < 1e-2
    assert act.shape == (tokens * k, gp.shape[1] // 2) and out.dtype == BF16
    ref = gemm.moe_reference(x.double(), gp, gs, gd.double(), dp, ds, dd.double(), ids, w.double())
    assert rel(out.view(tokens, k, h).sum(1, dtype=torch.float32), ref) < RTOL
    # the grouped GEMM on the same pairs: the activations agree to a bf16 ulp here and there
    routing = mr.pair_routing(ids, 16)
    act_mma = gemm.moe_gate_up(x, gp, gs, gd, routing, k)
    assert rel(act, act_mma) < 1e-2


def test_gemv_bf16_experts():
    gen = torch.Generator().manual_seed(9)
    e, h, i, k = 4, 64, 32, 2
    gu = (torch.randn(e, 2 * i, h, generator=gen) * 0.1).to(BF16).to(DEV)
    dn = (torch.randn(e, h, i, generator=gen) * 0.1).to(BF16).to(DEV)
    ones = torch.ones(e, 2, device=DEV), torch.ones(e, device=DEV)
    x = torch.randn(2, h, generator=gen).to(BF16).to(DEV)
    ids = torch.tensor([[0, 3], [3, 1]], dtype=torch.int32, device=DEV)
    w = torch.tensor([[0.7, 0.3], [0.6, 0.4]], device=DEV)
    act = gemv.gemv_gate_up(x, gu, gu, ones[0], ids)
    out = gemv.gemv_down(act, dn, dn, ones[1], ids, w).view(2, k, h).sum(1, dtype=torch.float32)
    ref = torch.zeros(2, h, dtype=torch.float64)
    for t in range(2):
        for j in range(k):
            g, u = (x[t].double() @ gu[ids[t, j]].double().T).cpu().chunk(2)
            ref[t] += w[t, j].item() * ((torch.nn.functional.silu(g) * u) @ dn[ids[t, j]].double().T.cpu())
    assert rel(out.cpu(), ref) < RTOL


def test_gemv_down_refuses_strided_expert_ids():
    """The down programs read their pair's expert before waiting for the kernel ahead: a copy of strided
    ids launched right before them could still be in flight, so strided ids are refused."""
    gen = torch.Generator().manual_seed(3)
    _, (dp, ds, dd) = _experts(gen)
    ids = torch.zeros(2, 6, dtype=torch.int32, device=DEV)[:, ::2]
    act = torch.zeros(6, dp.shape[-1] * 2, dtype=BF16, device=DEV)
    with pytest.raises(ValueError, match="contiguous topk_ids"):
        gemv.gemv_down(act, dp, ds, dd, ids, torch.ones(2, 3, device=DEV))


def test_gemv_refuses_a_k_that_no_tile_divides():
    gen = torch.Generator().manual_seed(1)
    (gp, gs, gd), _ = _experts(gen, h=48)
    x = torch.randn(1, 48, generator=gen).to(BF16).to(DEV)
    with pytest.raises(ValueError, match="input dimension 48"):
        gemv.gemv_gate_up(x, gp, gs, gd, torch.zeros(1, 2, dtype=torch.int32, device=DEV))


@pytest.mark.parametrize(
    "m,n,k", [(1, 96, 256), (1, 1281, 256), (3, 41, 2048), (2, 2048, 512), (4, 200, 4096)]
)
def test_bf16_gemv(m, n, k):
    """Any N: the router group's 1,281 rows end in a part-filled block of the kernel's output tile."""
    gen = torch.Generator().manual_seed(m)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(BF16).to(DEV)
    x = torch.randn(m, k, generator=gen).to(BF16).to(DEV)
    assert rel(gemv.bf16_gemv(x, w), x.double() @ w.double().T) < RTOL


def test_gemv_fits_only_weights_the_kernel_reads():
    x = torch.zeros(1, 64, dtype=BF16)
    w = torch.zeros(8, 64, dtype=BF16)
    assert not gemv.gemv_fits(x, w)  # the CPU takes torch
    if DEV.type == "cuda":
        x, w = x.to(DEV), w.to(DEV)
        assert gemv.gemv_fits(x, w)
        assert not gemv.gemv_fits(x, torch.zeros(64, 8, dtype=BF16, device=DEV).T)  # K not contiguous
        assert not gemv.gemv_fits(x, w[:, :32])  # K mismatch
        assert not gemv.gemv_fits(torch.zeros(2, 64, dtype=BF16, device=DEV), w)  # two rows
        assert gemv.gemv_fits(torch.zeros(2, 64, dtype=BF16, device=DEV), w, max_rows=4)  # allowed
        assert not gemv.gemv_fits(torch.zeros(5, 64, dtype=BF16, device=DEV), w, max_rows=4)
        wide = torch.zeros(gemv.FEW_ROWS_MAX_N + 8, 64, dtype=BF16, device=DEV)
        assert gemv.gemv_fits(x, wide) and not gemv.gemv_fits(
            torch.zeros(2, 64, dtype=BF16, device=DEV), wide, 4
        )
