"""The NVFP4 grouped GEMM for the routed experts (sorted and per-pair routing, weights-first prefill), the dense
NVFP4, bf16 and FP8 weight-only linears, against their dequantized torch references. Tolerances
(kernel_refs.py): relative L2 error 2e-2 for bf16 outputs; integer outputs exact."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_refs import BF16, BF16_INTERPRETER, DEV, RTOL, quantized, rel  # noqa: E402

from fp4moe.kernels import moe_router  # noqa: E402
from fp4moe.kernels import moe_routing as mr  # noqa: E402
from fp4moe.kernels import nvfp4_dequant as dq  # noqa: E402
from fp4moe.kernels import nvfp4_gemm as gemm  # noqa: E402
from fp4moe.kernels import nvfp4_moe_prefill as prefill  # noqa: E402


@pytest.mark.parametrize("mode", [1, 4, 7])
@pytest.mark.parametrize(
    "tokens,inter,split",
    [(1, 32, 0), (5, 32, 0), (70, 32, 0), (4, 48, 0), (1, 32, 2), (5, 48, 1), (20, 32, 2)],
)
def test_moe_experts_match_the_dequantized_reference(tokens, inter, split, mode, monkeypatch):
    """Fused silu(gate) * up epilogue (split 0), or gate/up partial sums over ``split`` K ranges finished by
    the down launch."""
    if mode >= 4 and DEV.type != "cuda":
        pytest.skip(BF16_INTERPRETER)
    monkeypatch.setattr(dq, "DEQUANT_MODE", mode)
    gen = torch.Generator().manual_seed(100 + tokens)
    e, h, i, k = 8, 64, inter, 3
    gp, gs, gd = quantized((e * 2, i, h), gen)
    gp, gs, gd = gp.view(e, 2 * i, h // 2), gs.view(e, 2 * i, h // 16), gd.view(e, 2).contiguous()
    dp, ds, dd = quantized((e, h, i), gen)
    x = torch.randn(tokens, h, generator=gen).to(BF16).to(DEV)
    ids, w = moe_router.router_reference(torch.randn(tokens, e, generator=gen).to(DEV), k)
    routing = mr.align(ids, e, 16 if tokens <= 16 else 64)
    bm = routing.bm
    tiles = gemm.Tiles(32, 128, 4, 2, split) if split else gemm.plan(bm, tokens)[0]
    act = gemm.moe_gate_up(x, gp, gs, gd, routing, k, tiles=tiles)
    assert act.shape == ((split, tokens * k, 2 * i) if split else (tokens * k, i))
    out = gemm.moe_down(act, dp, ds, dd, routing, w).view(tokens, k, h).sum(1)
    ref = gemm.moe_reference(x.double(), gp, gs, gd.double(), dp, ds, dd.double(), ids, w.double())
    assert rel(out, ref) < RTOL


@pytest.mark.parametrize("tokens,inter,kernel_launches", [(150, 32, 2), (350, 32, 2), (150, 48, 1)])
def test_weights_first_prefill_experts_match_the_reference(tokens, inter, kernel_launches, monkeypatch):
    """Prefill-sized row blocks (64 pairs; 128 where every expert gets 128) run nvfp4_moe_prefill's kernel:
    the weights as the MMA's first operand, N masked where the tile is wider than the projection. A K that
    is no multiple of its tile (down with I = 48) falls back to the row kernel for that launch, and then no
    block has 128 rows. Both launches against the dequantized reference, and against the row kernel on the
    same blocks: under the interpreter (fp32 dots) gate/up exactly and down within a bf16 ulp at under 1%
    of its elements (the epilogues round at the same places); on the GPU within the relative tolerance."""

    if dq.DEQUANT_MODE not in prefill.MODES:
        pytest.skip(f"dequantization mode {dq.DEQUANT_MODE} has no weights-first kernel")
    launches = []
    real = prefill.launch
    monkeypatch.setattr(prefill, "launch", lambda *a, **kw: launches.append(a[10]) or real(*a, **kw))
    gen = torch.Generator().manual_seed(tokens + inter)
    e, h, k = 8, 64, 3
    gp, gs, gd = quantized((e * 2, inter, h), gen)
    gp, gs, gd = gp.view(e, 2 * inter, h // 2), gs.view(e, 2 * inter, h // 16), gd.view(e, 2).contiguous()
    dp, ds, dd = quantized((e, h, inter), gen)
    x = torch.randn(tokens, h, generator=gen).to(BF16).to(DEV)
    ids, w = moe_router.router_reference(torch.randn(tokens, e, generator=gen).to(DEV), k)
    bm = gemm.block_m(tokens, k, e, weights_first=inter % 32 == 0)
    assert bm == (128 if tokens * k / e >= 128 and inter % 32 == 0 else 64)
    routing = mr.align(ids, e, bm)
    act = gemm.moe_gate_up(x, gp, gs, gd, routing, k)
    pairs = gemm.moe_down(act, dp, ds, dd, routing, w.float())
    assert launches == [gemm.GATED, gemm.WEIGHTED][:kernel_launches]
    out = pairs.view(tokens, k, h).sum(1)
    ref = gemm.moe_reference(x.double(), gp, gs, gd.double(), dp, ds, dd.double(), ids, w.double())
    assert rel(out, ref) < RTOL
    row_tiles = gemm.Tiles(64, 128, 4, 3)  # the row kernel on the same blocks
    row_act = gemm.moe_gate_up(x, gp, gs, gd, routing, k, tiles=row_tiles)
    row_pairs = gemm.moe_down(act, dp, ds, dd, routing, w.float(), tiles=row_tiles)
    if DEV.type == "cuda":
        assert rel(act, row_act) < RTOL and rel(pairs, row_pairs) < RTOL
        return
    assert torch.equal(act, row_act)
    ulp = pairs.float().abs().clamp(min=2**-126) * 2**-7  # one bf16 ulp (or less) of each element
    differ = pairs != row_pairs
    assert float(differ.float().mean()) < 0.01
    assert bool(((pairs.float() - row_pairs.float()).abs() <= ulp).all())


@pytest.mark.parametrize("h", [64, 96])
def test_wide_down_gives_the_narrow_launchs_outputs(h):
    """Weights-first down with two row tiles a program (``Tiles.wide``: rows n and n + bn share each
    activation tile) gives the one-tile launch's outputs; h = 96 with bn 32 leaves the second program's upper
    tile past N (masked). Exact under the interpreter (the same fp32 dot per element, same epilogue); on the
    GPU within the relative tolerance (different MMA tile shapes)."""
    if dq.DEQUANT_MODE not in prefill.MODES:
        pytest.skip(f"dequantization mode {dq.DEQUANT_MODE} has no weights-first kernel")
    gen = torch.Generator().manual_seed(h)
    tokens, e, inter, k = 150, 8, 32, 3
    dp, ds, dd = quantized((e, h, inter), gen)
    act = torch.randn(tokens * k, inter, generator=gen).to(BF16).to(DEV)
    ids, w = moe_router.router_reference(torch.randn(tokens, e, generator=gen).to(DEV), k)
    routing = mr.align(ids, e, 64)
    narrow = gemm.moe_down(
        act, dp, ds, dd, routing, w.float(), tiles=gemm.Tiles(32, 32, 4, 2, weights_first=True)
    )
    wide = gemm.moe_down(
        act, dp, ds, dd, routing, w.float(), tiles=gemm.Tiles(32, 32, 4, 2, weights_first=True, wide=True)
    )
    if DEV.type == "cuda":
        assert rel(wide, narrow) < RTOL
    else:
        assert torch.equal(wide, narrow)
    assert float(narrow.float().abs().amax()) > 0


@pytest.mark.parametrize("tokens", [1, 3])
def test_pair_routing_gives_the_sorted_routings_outputs(tokens):
    """A few tokens skip the sort: each (token, expert) pair is its own row block. Rows of a tile do not
    mix, so every pair's output is the sorted launch's, bit for bit (one shared expert included)."""
    gen = torch.Generator().manual_seed(7)
    e, h, i, k = 8, 64, 32, 3
    gp, gs, gd = quantized((e * 2, i, h), gen)
    gp, gs, gd = gp.view(e, 2 * i, h // 2), gs.view(e, 2 * i, h // 16), gd.view(e, 2).contiguous()
    dp, ds, dd = quantized((e, h, i), gen)
    x = torch.randn(tokens, h, generator=gen).to(BF16).to(DEV)
    ids, w = moe_router.router_reference(torch.randn(tokens, e, generator=gen).to(DEV), k)
    ids[-1, 0] = ids[0, 1]  # two tokens (or two slots) on one expert
    ids = ids.int()
    outs = []
    for routing in (mr.align(ids, e, 16), mr.pair_routing(ids, 16)):
        act = gemm.moe_gate_up(x, gp, gs, gd, routing, k)
        outs.append(gemm.moe_down(act, dp, ds, dd, routing, w))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("m,k", [(1, 128), (20, 128), (100, 128), (3, 192), (5, 48)])
def test_dense_nvfp4_linear(m, k):
    gen = torch.Generator().manual_seed(m)
    p, s, d = quantized((96, k), gen)  # K = 192: 64-wide tiles; K = 48: a masked ragged 32-wide tile
    x = torch.randn(m, k, generator=gen).to(BF16).to(DEV)
    assert rel(gemm.nvfp4_linear(x, p, s, d), gemm.linear_reference(x.double(), p, s, d.double())) < RTOL


@pytest.mark.parametrize("m", [1, 20])
def test_bf16_bit_dequantization_is_exact(m, monkeypatch):
    """Modes 4 and 7 (codes written into bf16 bits -- by Triton ops, or two at a time by inline PTX --
    and one bf16 multiply by the block scale) dequantize exactly as mode 1 does: every code, every finite
    positive block scale (subnormal ones too). Rows of the identity as inputs make each output one weight
    times the decode scale, with no sum whose order could differ (mode 7 adds even and odd k apart)."""
    if DEV.type != "cuda":
        pytest.skip(BF16_INTERPRETER)
    gen = torch.Generator().manual_seed(3)
    n, k = 64, 256
    packed = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8).to(DEV)
    scales = torch.randint(1, 0x7F, (n, k // 16), generator=gen, dtype=torch.uint8).view(torch.float8_e4m3fn)
    decode = torch.tensor(3e-3).to(DEV)
    picks = torch.randperm(k, generator=gen)[:m] if m < k else torch.arange(k)
    x = torch.eye(k, dtype=BF16)[picks].to(DEV)
    outs = {}
    for mode in (1, 4, 7):
        monkeypatch.setattr(dq, "DEQUANT_MODE", mode)
        outs[mode] = gemm.nvfp4_linear(x, packed, scales.to(DEV), decode)
    for mode in (4, 7):
        assert torch.equal(outs[1], outs[mode]), mode


@pytest.mark.parametrize("m,n,k", [(1, 96, 128), (3, 1281, 256), (4, 64, 192)])
def test_bf16_linear_for_a_few_rows(m, n, k):
    gen = torch.Generator().manual_seed(20 + m)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(BF16).to(DEV)
    x = torch.randn(m, k, generator=gen).to(BF16).to(DEV)
    assert rel(gemm.bf16_linear(x, w), x.double() @ w.double().T) < RTOL


@pytest.mark.parametrize("m,k", [(1, 128), (20, 192), (3, 48)])
def test_fp8_weight_only_linear(m, k):
    gen = torch.Generator().manual_seed(10 + m)
    w = torch.randn(80, k, generator=gen) * 0.05
    scale = w.abs().amax() / 448
    q = (w / scale).to(torch.float8_e4m3fn)
    x = torch.randn(m, k, generator=gen).to(BF16).to(DEV)
    out = gemm.fp8_linear(x, q.to(DEV), scale.to(DEV))
    assert rel(out, gemm.fp8_linear_reference(x.double(), q.to(DEV), scale.to(DEV))) < RTOL
