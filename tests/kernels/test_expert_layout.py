"""Experts in ``kernels.expert_layout``'s tile order: the reordering round-trips, ``tiled_offsets`` addresses
the same bytes ``tile_experts`` moved, and every kernel that reads experts computes from tiled weights exactly
what it computes from row-major ones (the same bytes and scales in the same arithmetic: equal, not close).
CPU under Triton's interpreter for the Triton kernels (modes 1 and 4 of the dequantization there; 7 on the GPU),
the Gluon tensor-core GEMVs on the GPU only."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from kernel_refs import BF16, DEV, RTOL, rel  # noqa: E402
from test_gemv import _experts  # noqa: E402

from fp4moe.kernels import expert_layout as el  # noqa: E402
from fp4moe.kernels import moe_dispatch as dispatch  # noqa: E402
from fp4moe.kernels import moe_router  # noqa: E402
from fp4moe.kernels import moe_routing as mr  # noqa: E402
from fp4moe.kernels import nvfp4_dequant as dq  # noqa: E402
from fp4moe.kernels import nvfp4_gemm as gemm  # noqa: E402
from fp4moe.kernels import nvfp4_gemv as gemv  # noqa: E402


@pytest.mark.parametrize(
    ("rows", "kb", "step", "gated"), [(128, 64, 32, True), (64, 128, 64, True), (64, 128, 64, False)]
)
def test_tiles_round_trip_and_keep_each_step_contiguous(rows, kb, step, gated):
    gen = torch.Generator().manual_seed(rows + kb)
    packed = torch.randint(0, 256, (3, rows, kb), dtype=torch.uint8, generator=gen)
    scales = torch.randint(0, 120, (3, rows, kb // 8), dtype=torch.uint8, generator=gen).view(
        torch.float8_e4m3fn
    )
    tp, ts = el.tile_experts(packed, scales, step, gated)
    assert tp.shape == packed.shape and ts.dtype == scales.dtype and not torch.equal(tp, packed)
    back = el.untile_experts(tp, ts, step, gated)
    assert torch.equal(back[0], packed) and torch.equal(back[1].view(torch.uint8), scales.view(torch.uint8))
    # the first tile's first step: 16 gate rows then the same 16 up rows (or 16 down rows), step bytes each
    half = rows // 2
    first = [*range(16), *range(half, half + 16)] if gated else list(range(16))
    assert torch.equal(tp[1].flatten()[: len(first) * step], packed[1, first, :step].flatten())
    with pytest.raises(ValueError, match="do not tile"):
        el.tile_experts(packed[:, :, :48], scales[:, :, :6], 32, gated)


@triton.jit
def _gather(src, out, ROWS: tl.constexpr, COLS: tl.constexpr, HALF: tl.constexpr, GATED: tl.constexpr,
            STEP: tl.constexpr):  # fmt: skip
    rows, cols = tl.arange(0, ROWS), tl.arange(0, COLS)
    v = tl.load(src + el.tiled_offsets(rows, cols, COLS, HALF, GATED, STEP))
    tl.store(out + rows[:, None] * COLS + cols[None, :], v)


@pytest.mark.parametrize(("gated", "step"), [(True, 64), (True, 32), (False, 64), (False, 32), (False, 0)])
def test_tiled_offsets_address_the_bytes_tile_experts_moved(gated, step):
    """Codes at ``step``-byte steps and block scales at ``step / 8``, as every Triton kernel addresses them."""
    rows, kb = 64, 128
    gen = torch.Generator().manual_seed(1)
    packed = torch.randint(0, 256, (1, rows, kb), dtype=torch.uint8, generator=gen)
    scales = torch.randint(0, 256, (1, rows, kb // 8), dtype=torch.uint8, generator=gen)
    tp, ts = el.tile_experts(packed, scales, step, gated) if step else (packed, scales)
    for src, ref, width, s in ((tp, packed, kb, step), (ts, scales, kb // 8, step // 8)):
        out = torch.empty(rows, width, dtype=torch.uint8, device=DEV)
        _gather[(1,)](src.to(DEV), out, ROWS=rows, COLS=width, HALF=rows // 2, GATED=gated, STEP=s)
        assert torch.equal(out.cpu(), ref[0])


def _setup(tokens, h=256, i=128, seed=0):
    gen = torch.Generator().manual_seed(700 + tokens + seed)
    gu, dn = _experts(gen, e=8, h=h, i=i)
    k = 3
    x = torch.randn(tokens, h, generator=gen).to(BF16).to(DEV)
    ids, w = moe_router.router_reference(torch.randn(tokens, 8, generator=gen).to(DEV), k)
    return gu, dn, x, ids.int().contiguous(), w.float(), k


def _tiled(gu, dn, step):
    return (*el.tile_experts(*gu[:2], step, True), gu[2]), (*el.tile_experts(*dn[:2], step, False), dn[2])


@pytest.mark.parametrize("mode", [1, 4, 7])
@pytest.mark.parametrize("step", [32, 64])
def test_grouped_gemms_and_gemvs_read_tiled_experts_alike(step, mode, monkeypatch):
    """The CUDA-core GEMVs (pairs), the row kernel (decode-sized blocks, and split-K partials), the
    weights-first prefill kernel (blocks of 64): tiled weights give the row-major weights' outputs exactly."""
    if mode >= 4 and DEV.type != "cuda":
        pytest.skip("modes 4 and 7 (bf16-bit dequantization): GPU only")
    monkeypatch.setattr(dq, "DEQUANT_MODE", mode)
    gu, dn, x, ids, w, k = _setup(3)
    tgu, tdn = _tiled(gu, dn, step)
    act = gemv.gemv_gate_up(x, *gu, ids)
    assert torch.equal(gemv.gemv_gate_up(x, *tgu, ids, tile=step), act)
    out = gemv.gemv_down(act, *dn, ids, w)
    assert torch.equal(gemv.gemv_down(act, *tdn, ids, w, tile=step), out)
    for bm in (16, 64):  # the row kernel; blocks of 64 in modes 1 and 7: the weights-first kernel
        routing = mr.align(ids, 8, bm)
        act = gemm.moe_gate_up(x, *gu, routing, k)
        assert torch.equal(gemm.moe_gate_up(x, *tgu, routing, k, tile=step), act)
        out = gemm.moe_down(act, *dn, routing, w)
        assert torch.equal(gemm.moe_down(act, *tdn, routing, w, tile=step), out)
    split = gemm.Tiles(32, 64, 4, 2, split=2)  # gate and up rows side by side in one launch (PARTIAL)
    routing = mr.align(ids, 8, 16)
    partial = gemm.moe_gate_up(x, *gu, routing, k, tiles=split)
    assert torch.equal(gemm.moe_gate_up(x, *tgu, routing, k, tiles=split, tile=step), partial)
    assert torch.equal(
        gemm.moe_down(partial, *tdn, routing, w, tile=step), gemm.moe_down(partial, *dn, routing, w)
    )


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 3, 16, 40, 130])
def test_moe_pairs_on_tiled_experts(tokens):
    """The engine's entry at every token count (GEMVs, tensor-core GEMVs over pairs and blocks, grouped GEMM)
    on experts tiled as the runner tiles them (``tile_step``) against the row-major ones and the reference."""
    if DEV.type != "cuda" or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("tiles are made where the tensor-core GEMVs run (an NVIDIA GPU, sm89+)")
    gu, dn, x, ids, w, k = _setup(tokens, h=256, i=256)  # two K steps of 64 bytes in both launches
    row_major = dispatch.ExpertWeights(gu, dn)
    step = dispatch.tile_step(row_major)
    if step == 0:
        pytest.skip("no tensor-core GEMVs here (Triton without Gluon, or another dequantization mode)")
    assert step == 64
    tiled = dispatch.ExpertWeights(*_tiled(gu, dn, step), step)
    out = dispatch.moe_pairs(tiled, x, ids, w)
    assert rel(out, dispatch.moe_pairs(row_major, x, ids, w)) < 1e-2  # tensor-core GEMV tiles differ
    ref = gemm.moe_reference(x.double(), *gu[:2], gu[2].double(), *dn[:2], dn[2].double(), ids, w.double())
    assert rel(out.view(tokens, k, -1).sum(1, dtype=torch.float32), ref) < RTOL


def test_routed_experts_tile_in_place_and_dequantize_as_before():
    from fp4moe.layers.moe import RoutedExperts

    gen = torch.Generator().manual_seed(5)
    (gp, gs, gd), (dp, ds, dd) = _experts(gen, e=4, h=128, i=64)
    m = RoutedExperts(4, 128, 64)
    m.use_nvfp4()
    for name, t in (("gate_up_packed", gp), ("gate_up_scales", gs), ("gate_up_decode", gd), ("down_packed", dp),
                    ("down_scales", ds), ("down_decode", dd)):  # fmt: skip
        getattr(m, name).copy_(t.cpu())
    before = [m.weights(e, torch.float32) for e in range(4)]
    x = torch.randn(5, 128, generator=gen)
    ids, w = moe_router.router_reference(torch.randn(5, 4, generator=gen), 2)
    y = m(x, ids, w)
    m.tile_for_kernels(32)
    assert m.kernel_weights().tile == 32 and m.tile == 32
    assert not torch.equal(m.gate_up_packed, gp.cpu())
    for e in range(4):
        assert all(torch.equal(a, b) for a, b in zip(m.weights(e, torch.float32), before[e], strict=True))
    assert torch.equal(m(x, ids, w), y)
    with pytest.raises(ValueError, match="row-major"):
        m.tile_for_kernels(32)
    m.untile()
    assert m.tile == 0 and torch.equal(m.gate_up_packed, gp.cpu()) and torch.equal(m.down_packed, dp.cpu())
    with pytest.raises(ValueError, match="row-major already"):
        m.untile()
