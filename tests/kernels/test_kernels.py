"""Each GPU kernel against its torch reference: on CUDA when there is one, else on the CPU under Triton's
interpreter (tests/conftest.py sets TRITON_INTERPRET). Fresh random inputs per case, bf16 activations.

Tolerances: relative L2 error 2e-2 for bf16 outputs -- the kernels keep the CPU path's bf16 roundings at
the same places but accumulate in a different order and skip a few intermediate roundings (e.g. the
decode scale is applied to the fp32 accumulator rather than to each bf16 weight), so single elements differ
by a bf16 ulp; a wrong index or scale gives errors of order 1. Integer outputs (routing tables) are exact.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from fp4moe.engine.cache import DeltaNetStates, KVCache  # noqa: E402
from fp4moe.engine.context import StepContext  # noqa: E402
from fp4moe.kernels import attention as attn_k  # noqa: E402
from fp4moe.kernels import gdn_decode as gdn_k  # noqa: E402
from fp4moe.kernels import moe_router, norm  # noqa: E402
from fp4moe.kernels import moe_routing as mr  # noqa: E402
from fp4moe.kernels import nvfp4_dequant as dq  # noqa: E402
from fp4moe.kernels import nvfp4_gemm as gemm  # noqa: E402
from fp4moe.kernels import nvfp4_moe_prefill as prefill  # noqa: E402
from fp4moe.layers.attention import GatedAttention  # noqa: E402
from fp4moe.layers.deltanet import GatedDeltaNet  # noqa: E402
from fp4moe.layers.norm import rms_norm_zero_centred  # noqa: E402
from fp4moe.layers.rope import RopeConfig, Rotary  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BF16 = torch.bfloat16
RTOL = 2e-2
# modes 4 and 7 compute in bf16 on bf16 bit patterns, subnormals included (7 through inline PTX);
# Triton's interpreter flushes bf16 subnormals, its bf16 multiply is not IEEE and it runs no PTX, so they
# are checked on the GPU only
BF16_INTERPRETER = "bf16-bit dequantization needs IEEE bf16 arithmetic: GPU only"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all()
    return float((a - b).norm() / b.norm())


def quantized(shape, gen, per=None):
    """Random weights [.., N, K] quantized with one global scale per [N, K] matrix (or per ``per`` rows);
    MSE block scales, the quantizer's default (any e4m3 scale, not just RTN's amax/6 ones)."""
    from fp4moe.quantize.experts import quantize_weight
    from fp4moe.quantize.scales import ScaleMethod

    w = torch.randn(*shape, generator=gen) * torch.rand(*shape[:-2], 1, 1, generator=gen).add(0.5)
    q = quantize_weight(w, ScaleMethod.MSE)
    return q.packed.to(DEV), q.block_scales.to(DEV), (1.0 / q.global_scale).float().to(DEV)


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


def test_router_and_shared_activation():
    gen = torch.Generator().manual_seed(3)
    t, e, k, s = 9, 32, 8, 24
    proj = torch.randn(t, e + 2 * s + 1, generator=gen).to(BF16).to(DEV)
    ids, w, shared = moe_router.route(proj, e, k, s)
    ref_ids, ref_w = moe_router.router_reference(proj[:, :e], k)
    # equal bf16 logits may come in either order (torch.topk leaves ties unordered): compare as sets
    order, ref_order = ids.long().sort(-1), ref_ids.sort(-1)
    assert torch.equal(order.values.cpu(), ref_order.values.cpu())
    torch.testing.assert_close(
        w.gather(1, order.indices), ref_w.gather(1, ref_order.indices), rtol=1e-5, atol=1e-6
    )
    g, u = proj[:, e : e + s], proj[:, e + s : e + 2 * s]
    assert rel(shared, torch.nn.functional.silu(g) * u) < RTOL


def test_add_norm_and_moe_combine():
    gen = torch.Generator().manual_seed(4)
    t, n, k = 5, 96, 4
    h, a = (torch.randn(t, n, generator=gen).to(BF16).to(DEV) for _ in range(2))
    w = (0.1 * torch.randn(n, generator=gen)).to(BF16).to(DEV)
    h_out, x = norm.add_rms_norm(h, a, w, 1e-6)
    assert rel(h_out, h + a) < 1e-2 and rel(x, rms_norm_zero_centred(h + a, w, 1e-6)) < RTOL
    _, x0 = norm.add_rms_norm(h, None, w, 1e-6)
    assert rel(x0, rms_norm_zero_centred(h, w, 1e-6)) < RTOL
    y = torch.randn(t * k, n, generator=gen).to(DEV)
    shared = torch.randn(t, n, generator=gen).to(BF16).to(DEV)
    proj = torch.randn(t, 7, generator=gen).to(BF16).to(DEV)
    h2, x2 = norm.moe_combine(h, y, k, shared, proj, 6, w, 1e-6)
    ref = h.float() + y.view(t, k, n).sum(1) + torch.sigmoid(proj[:, 6:7].float()) * shared.float()
    assert rel(h2, ref) < RTOL and rel(x2, rms_norm_zero_centred(ref.to(BF16), w, 1e-6)) < RTOL


def _gdn_layer(gen, hk=2, hv=4, dk=16, dv=32, hidden=64):
    layer = GatedDeltaNet(hidden, hk, hv, dk, dv, 4, 1e-6, layer_id=0)
    for p in layer.parameters():
        p.data = (torch.randn(p.shape, generator=gen) * 0.2).to(BF16)
    layer.A_log.data = torch.rand(hv, generator=gen).log().float()
    layer.dt_bias.data = torch.rand(hv, generator=gen).float()
    return layer.to(DEV)


@pytest.mark.parametrize("n", [2, 3, 37, 100])
def test_causal_conv_matches_the_layers_conv(n):
    """The prefill conv kernel against the layer's torch path (on the CPU): the output exactly (both round
    the fp32 sum to bf16 before and after the SiLU; single elements may differ by a bf16 ulp where the
    fp32 sums' order flips a rounding), the new state exactly (it is a copy of inputs)."""
    from fp4moe.kernels.causal_conv import causal_conv_silu

    gen = torch.Generator().manual_seed(n)
    layer = GatedDeltaNet(64, 2, 4, 16, 16, 4, 1e-6, 0)
    layer.conv1d_weight.data = (torch.randn(layer.conv_dim, 1, 4, generator=gen) * 0.5).to(BF16)
    proj = torch.randn(n, layer.conv_dim + 8, generator=gen).to(BF16)  # strided rows, as in_proj's output
    x = proj[:, : layer.conv_dim]
    state = torch.randn(layer.conv_dim, 3, generator=gen).to(BF16)
    ref, ref_state = layer._conv(x, state)
    out, new_state = causal_conv_silu(x.to(DEV), state.to(DEV), layer.conv1d_weight.to(DEV))
    assert torch.equal(new_state.cpu(), ref_state)
    diff = (out.cpu().float() - ref.float()).abs()
    assert float(diff.max()) <= float(ref.float().abs().max()) * 2**-7  # at most a bf16 ulp
    assert float((diff > 0).float().mean()) < 0.02


@pytest.mark.parametrize("t", [5, 70])
def test_gated_norm_matches_the_layers(t):
    """A program per (row, head) for a few rows, every head of a row in one program for many."""
    from fp4moe.layers.norm import gated_rms_norm

    gen = torch.Generator().manual_seed(3)
    hv, dv = 4, 32
    o = torch.randn(t, hv, dv, generator=gen).to(BF16)
    zs = torch.randn(t, hv * dv + 8, generator=gen).to(BF16)  # strided rows
    w = torch.randn(dv, generator=gen).to(BF16)
    ref = gated_rms_norm(o, zs[:, : hv * dv].view(t, hv, dv), w, 1e-6).reshape(t, -1)
    out = gdn_k.gated_norm(o.view(t, -1).to(DEV), zs[:, : hv * dv].to(DEV), w.to(DEV), 1e-6, hv)
    assert rel(out.cpu(), ref) < RTOL


@pytest.mark.parametrize("v_splits", [1, 2, 4, None])
def test_gdn_decode_matches_the_layer_step_by_step(v_splits):
    gen = torch.Generator().manual_seed(5)
    layer = _gdn_layer(gen)
    hk, hv, dk, dv = layer.num_k_heads, layer.num_v_heads, layer.k_dim, layer.v_dim
    b, steps = 3, 6
    states = DeltaNetStates(layer.conv_dim, 4, hv, dk, dv, BF16, DEV)
    ring = torch.randn(5, 4, layer.conv_dim).to(BF16).to(DEV)  # stale garbage: must never be read
    state = torch.randn(5, hv, dk, dv).to(DEV)
    slots = torch.tensor([3, 0, 4], dtype=torch.int32, device=DEV)
    w_in = torch.cat(
        [layer.in_proj_qkv.weight, layer.in_proj_z.weight, layer.in_proj_b.weight, layer.in_proj_a.weight]
    )
    for step in range(steps):
        x = torch.randn(b, 64, generator=gen).to(BF16).to(DEV)
        ctx = StepContext([1] * b, [step] * b, slots.tolist(), KVCache(), states)
        ref = layer(x, ctx)
        core = gdn_k.gdn_decode(
            x @ w_in.T, layer.conv1d_weight.view(layer.conv_dim, 4), ring, state, slots,
            torch.full((b,), step, dtype=torch.int32, device=DEV), layer.A_log, layer.dt_bias, layer.norm_weight,
            layer.eps, (hk, hv, dk, dv), v_splits=v_splits,
        )  # fmt: skip
        assert rel(layer.out_proj(core), ref) < RTOL, step
    for i, slot in enumerate(slots.tolist()):
        assert rel(state[slot], states.get(0, slot)[1]) < 1e-2, i


def test_gdn_verify_walks_each_sequences_tokens_and_rolls_back():
    """Speculative verification: T = 3 tokens per sequence in one launch (outputs and the state after each
    token against the layer run token by token), then rollback to a different accepted count per sequence
    (state from the history; the ring needs no repair) and plain decoding on from there."""
    gen = torch.Generator().manual_seed(6)
    layer = _gdn_layer(gen)
    hk, hv, dk, dv = layer.num_k_heads, layer.num_v_heads, layer.k_dim, layer.v_dim
    b, t, kc = 3, 3, 4
    dims = (hk, hv, dk, dv)
    states = DeltaNetStates(layer.conv_dim, kc, hv, dk, dv, BF16, DEV)
    ring = torch.randn(5, kc - 1 + t, layer.conv_dim).to(BF16).to(DEV)  # stale garbage: never read
    state = torch.randn(5, hv, dk, dv).to(DEV)
    history = torch.zeros(b * t, hv, dk, dv, device=DEV)
    slots = [3, 0, 4]
    w_in = torch.cat(
        [layer.in_proj_qkv.weight, layer.in_proj_z.weight, layer.in_proj_b.weight, layer.in_proj_a.weight]
    )

    def kernel(x, position, per_seq):
        rows = torch.tensor([s for s in slots for _ in range(per_seq)], dtype=torch.int32, device=DEV)
        pos = torch.tensor(
            [position + j for _ in slots for j in range(per_seq)], dtype=torch.int32, device=DEV
        )
        core = gdn_k.gdn_decode(
            x @ w_in.T, layer.conv1d_weight.view(layer.conv_dim, kc), ring, state, rows, pos, layer.A_log,
            layer.dt_bias, layer.norm_weight, layer.eps, dims, tokens_per_seq=per_seq, history=history,
        )  # fmt: skip
        return layer.out_proj(core)

    def reference(x, position, seq):
        ctx = StepContext([1], [position], [slots[seq]], KVCache(), states)
        return layer(x[None], ctx)[0]

    for step in range(4):  # plain decoding first: positions 0..3
        x = torch.randn(b, 64, generator=gen).to(BF16).to(DEV)
        got = kernel(x, step, 1)
        for i in range(b):
            assert rel(got[i], reference(x[i], step, i)) < RTOL, step
    p = 4
    x = torch.randn(b * t, 64, generator=gen).to(BF16).to(DEV)
    got = kernel(x, p, t)
    accepted = [0, 2, 1]
    for i, slot in enumerate(slots):
        before = states.snapshot(slot)
        for j in range(t):
            assert rel(got[i * t + j], reference(x[i * t + j], p + j, i)) < RTOL, (i, j)
            assert rel(history[i * t + j], states.get(0, slot)[1]) < 1e-2, (i, j)
        states.restore(slot, before)  # the reference keeps only the accepted tokens
        for j in range(accepted[i] + 1):
            reference(x[i * t + j], p + j, i)
        state[slot] = history[i * t + accepted[i]]
    for step in range(2):  # plain decoding on, each sequence from its own position
        x = torch.randn(b, 64, generator=gen).to(BF16).to(DEV)
        for i, slot in enumerate(slots):
            position = p + accepted[i] + 1 + step
            rows = torch.tensor([slot], dtype=torch.int32, device=DEV)
            pos = torch.tensor([position], dtype=torch.int32, device=DEV)
            core = gdn_k.gdn_decode(
                x[i : i + 1] @ w_in.T, layer.conv1d_weight.view(layer.conv_dim, kc), ring, state, rows, pos,
                layer.A_log, layer.dt_bias, layer.norm_weight, layer.eps, dims,
            )  # fmt: skip
            assert rel(layer.out_proj(core)[0], reference(x[i], position, i)) < RTOL, (step, i)


def _attention_layer(gen, h=4, hkv=2, d=32, hidden=64):
    layer = GatedAttention(hidden, h, hkv, d, 1e-6, layer_id=0)
    for p in layer.parameters():
        p.data = (torch.randn(p.shape, generator=gen) * 0.2).to(BF16)
    return layer.to(DEV)


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_paged_attention_matches_the_layer(kv_dtype):
    gen = torch.Generator().manual_seed(6)
    layer = _attention_layer(gen)
    h, hkv, d, page = 4, 2, 32, 16
    rope = Rotary(RopeConfig(head_dim=d, mrope_section=(2, 1, 1)), DEV)
    lengths = [1, 37, 80]  # prompt lengths; then one decode step each
    kv = KVCache(kv_dtype)
    states = DeltaNetStates(8, 4, 1, 4, 4, BF16, DEV)
    cache_dtype = torch.float8_e4m3fn if kv_dtype == "fp8" else BF16
    pages = 24
    k_cache = torch.randn(pages, page, hkv, d).to(cache_dtype).to(DEV)
    v_cache = torch.randn(pages, page, hkv, d).to(cache_dtype).to(DEV)
    perm = torch.randperm(pages, generator=gen)
    table = torch.zeros(len(lengths), 8, dtype=torch.int32)
    used = 0
    for s, n in enumerate(lengths):
        need = -(-(n + 1) // page)
        table[s, :need] = perm[used : used + need]
        used += need
    table = table.to(DEV)
    w_qkv = torch.cat([layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight])
    kv_scales = torch.ones(2, device=DEV)

    def slot_map(s, positions):
        return (table[s, positions // page].long() * page + positions % page).to(torch.int32)

    for s, n in enumerate(lengths):  # prefill: reference forward; kernel writes the same keys/values
        x = torch.randn(n, 64, generator=gen).to(BF16).to(DEV)
        pos = torch.arange(n, device=DEV)
        cos, sin = rope.cos_sin(pos, BF16)
        layer(x, cos, sin, StepContext([n], [0], [s], kv, states))
        if kv_dtype == "fp8":
            kv_scales = torch.stack(kv.scales[0]).float().to(DEV)
        attn_k.qk_norm_rope_store(
            x @ w_qkv.T, cos, sin, layer.q_norm.weight, layer.k_norm.weight, k_cache, v_cache,
            slot_map(s, pos), kv_scales, 1e-6, (h, hkv, d),
        )  # fmt: skip
    x = torch.randn(len(lengths), 64, generator=gen).to(BF16).to(DEV)
    pos = torch.tensor(lengths, device=DEV)
    cos, sin = rope.cos_sin(pos, BF16)
    ref = layer(x, cos, sin, StepContext([1] * len(lengths), lengths, list(range(len(lengths))), kv, states))
    qkv = x @ w_qkv.T
    slots = torch.cat([slot_map(s, pos[s : s + 1]) for s in range(len(lengths))])
    q = attn_k.qk_norm_rope_store(
        qkv,
        cos,
        sin,
        layer.q_norm.weight,
        layer.k_norm.weight,
        k_cache,
        v_cache,
        slots,
        kv_scales,
        1e-6,
        (h, hkv, d),
    )
    out = attn_k.paged_decode_attention(
        q,
        qkv,
        k_cache,
        v_cache,
        table,
        (pos + 1).to(torch.int32),
        kv_scales,
        max_len=128,
        dims=(h, hkv, d),
        min_split=32,
        target_programs=264,  # several splits of 32 tokens, as on the GPU (the interpreter's default: one)
    )
    assert rel(layer.o_proj(out), ref) < RTOL


def _varlen_rows(gen, lengths, width):
    """Flat rows of several sequences and their layout (StepContext's device tensors)."""
    x = torch.randn(sum(lengths), width + 8, generator=gen).to(BF16)[:, :width]  # strided, as in_proj's
    ctx = StepContext(list(lengths), [0] * len(lengths), list(range(len(lengths))), KVCache(), None)
    return x, ctx


def test_causal_conv_varlen_is_each_sequence_alone():
    """One launch over several sequences' rows gives, row for row, what the single-sequence launch gives
    each sequence on its own (same kernel, same sums: exactly), and the new states equal the layer's."""
    from fp4moe.kernels.causal_conv import causal_conv_silu, causal_conv_silu_varlen

    gen = torch.Generator().manual_seed(11)
    layer = GatedDeltaNet(64, 2, 4, 16, 16, 4, 1e-6, 0)
    layer.conv1d_weight.data = (torch.randn(layer.conv_dim, 1, 4, generator=gen) * 0.5).to(BF16)
    # short ones after others: their new state reaches into their old; 39 and 40 put 32-row blocks' starts 1 and
    # 2 rows after their sequence's first row (those blocks need the conv state)
    lengths = [2, 1, 5, 37, 1, 3, 70, 39, 40]
    x, ctx = _varlen_rows(gen, lengths, layer.conv_dim)
    states = torch.randn(len(lengths), layer.conv_dim, 3, generator=gen).to(BF16)
    t = ctx.tensors(DEV)
    w = layer.conv1d_weight.to(DEV)
    out, new = causal_conv_silu_varlen(x.to(DEV), states.to(DEV), w, t.token_seq, t.starts, t.ends)
    for i, (a, b) in enumerate(ctx.spans()):
        alone, _ = causal_conv_silu(x[a:b].to(DEV), states[i].to(DEV), w)
        _, ref_state = layer._conv(x[a:b], states[i])
        assert torch.equal(out[a:b].cpu(), alone.cpu()), i
        assert torch.equal(new[i].cpu(), ref_state), i


def test_slot_states_gather_and_scatter_are_get_and_set():
    """The GPU states' batched read/write of a step against the per-slot get/set: exact (copies), stale
    ring entries and states of a fresh sequence read as zeros, positions wrap around the ring."""
    from fp4moe.engine.paged_cache import SlotStates

    gen = torch.Generator().manual_seed(12)
    conv_dim, kc, hv, dk, dv = 24, 4, 2, 8, 8
    states = SlotStates([7], 6, conv_dim, kc, hv, dk, dv, BF16, DEV, ring_len=6)
    states.ring.copy_(torch.randn(states.ring.shape, generator=gen).to(BF16))
    states.rec.copy_(torch.randn(states.rec.shape, generator=gen))
    slots, cached, lens = [3, 0, 5, 1], [0, 2, 9, 13], [4, 1, 2, 7]
    ctx = StepContext(lens, cached, slots, KVCache(), states)
    conv, rec = states.gather(7, ctx)
    for j, (slot, pos) in enumerate(zip(slots, cached, strict=True)):
        ref_conv, ref_rec = states.get(7, slot, pos)
        assert torch.equal(conv[j].cpu(), ref_conv.cpu()) and torch.equal(rec[j].cpu(), ref_rec.cpu()), j
    new_conv = torch.randn(conv.shape, generator=gen).to(BF16).to(DEV)
    new_rec = torch.randn(rec.shape, generator=gen).to(DEV)
    states.scatter(7, ctx, new_conv, new_rec)
    for j, (slot, pos, n) in enumerate(zip(slots, cached, lens, strict=True)):
        got_conv, got_rec = states.get(7, slot, pos + n)
        valid = torch.arange(pos + n - kc + 1, pos + n) >= 0  # positions before 0 read as zeros
        assert torch.equal(got_conv.cpu(), torch.where(valid, new_conv[j].cpu(), 0)), j
        assert torch.equal(got_rec.cpu(), new_rec[j].cpu()), j


def _torch_varlen_rule(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                       cu_seqlens, cu_seqlens_cpu, chunk_indices):  # fmt: skip
    """fla's varlen chunked rule, as the layer's torch path computes each sequence (the CPU's stand-in)."""
    from fp4moe.layers.deltanet import delta_rule_chunked, delta_rule_recurrent, l2_normalize

    assert use_qk_l2norm_in_kernel and output_final_state and torch.equal(cu_seqlens.cpu(), cu_seqlens_cpu)
    lens = cu_seqlens_cpu.diff().tolist()  # fla's 64-token chunks: (sequence, chunk within it)
    assert chunk_indices.tolist() == [[i, j] for i, n in enumerate(lens) for j in range(-(-n // 64))]
    rep = v.shape[2] // q.shape[2]
    outs, finals = [], []
    for i in range(len(cu_seqlens_cpu) - 1):
        a, b = int(cu_seqlens_cpu[i]), int(cu_seqlens_cpu[i + 1])
        qi = l2_normalize(q[0, a:b].float()).repeat_interleave(rep, dim=1) * scale
        ki = l2_normalize(k[0, a:b].float()).repeat_interleave(rep, dim=1)
        rule = delta_rule_recurrent if b - a == 1 else delta_rule_chunked
        o, final = rule(qi, ki, v[0, a:b].float(), g[0, a:b], beta[0, a:b].float(), initial_state[i])
        outs.append(o.to(v.dtype))
        finals.append(final)
    return torch.cat(outs)[None], torch.stack(finals)


def test_deltanet_varlen_prefill_is_each_sequence_alone(monkeypatch):
    """A step of several sequences with cached history (prompt chunks of 1-70 tokens, one fresh) through
    the batched prefill (one conv launch, one chunked-rule call, states by device indexing) against the
    layer one sequence at a time: outputs and the states left behind. On the GPU with fla's kernels; on the
    CPU with a torch stand-in for fla's varlen call (same math as the per-sequence path), which checks the
    batching: the offsets, the gathered and stored states, the conv across sequence boundaries."""
    from fp4moe.engine.paged_cache import SlotStates
    from fp4moe.layers import deltanet

    if not (DEV.type == "cuda" and deltanet._fla_chunk() is not None):
        monkeypatch.setattr(deltanet, "_fla_chunk", lambda: _torch_varlen_rule)
    monkeypatch.setattr(deltanet, "_varlen_prefill", lambda x, ctx: True)  # a 1-token row included
    gen = torch.Generator().manual_seed(13)
    layer = _gdn_layer(gen)
    dims = (layer.conv_dim, 4, layer.num_v_heads, layer.k_dim, layer.v_dim, BF16, DEV)
    batched, alone = SlotStates([0], 5, *dims), SlotStates([0], 5, *dims)
    slots, history = [4, 1, 2, 0], [5, 1, 66, 0]  # slot 0: a fresh prompt
    for slot, n in zip(slots, history, strict=True):  # the same history in both
        if n:
            x = torch.randn(n, 64, generator=gen).to(BF16).to(DEV)
            for states in (batched, alone):
                monkeypatch.setattr(deltanet, "_varlen_prefill", lambda x, ctx: False)
                layer(x, StepContext([n], [0], [slot], KVCache(), states))
    monkeypatch.setattr(deltanet, "_varlen_prefill", lambda x, ctx: True)
    lengths = [3, 1, 70, 9]
    x = torch.randn(sum(lengths), 64, generator=gen).to(BF16).to(DEV)
    got = layer(x, StepContext(lengths, history, slots, KVCache(), batched))
    monkeypatch.setattr(deltanet, "_varlen_prefill", lambda x, ctx: False)
    ctx = StepContext(lengths, history, slots, KVCache(), None)
    for i, (a, b) in enumerate(ctx.spans()):
        ref = layer(x[a:b], StepContext([b - a], [history[i]], [slots[i]], KVCache(), alone))
        assert rel(got[a:b], ref) < RTOL, i
        end = history[i] + b - a
        c_got, r_got = batched.get(0, slots[i], end)
        c_ref, r_ref = alone.get(0, slots[i], end)
        assert torch.equal(c_got, c_ref), i  # copies of the conv inputs
        assert rel(r_got, r_ref) < 1e-2, i


@pytest.mark.parametrize("dtype", ["auto", "fp8"])
def test_paged_append_step_is_append_per_sequence(dtype):
    """A step's keys/values stored at once (one scatter, the step's device layout) against ``append`` one
    sequence at a time: the same pages, lengths and returned k/v (exact: copies, and the same fp8 rounding
    with the scale from the first sequence's rows), fresh prompts and continuing chunks mixed."""
    from fp4moe.engine.paged_cache import PagedKVCache

    gen = torch.Generator().manual_seed(15)
    caches = [PagedKVCache([3], 64, 4, 2, 8, 6, 64, dtype, BF16, DEV) for _ in range(2)]
    history = {5: 6, 1: 3}  # slot -> tokens already cached (the rest are fresh)
    for slot, n in history.items():
        k, v = (torch.randn(n, 2, 8, generator=gen).to(BF16).to(DEV) for _ in range(2))
        for cache in caches:
            cache.append(3, slot, k, v)
    slots, lengths = [0, 5, 2, 1], [7, 2, 1, 5]
    cached = [history.get(s, 0) for s in slots]
    k, v = (torch.randn(sum(lengths), 2, 8, generator=gen).to(BF16).to(DEV) for _ in range(2))
    ctx = StepContext(lengths, cached, slots, caches[0], None)
    got = caches[0].append_step(3, ctx, k, v)
    want = [caches[1].append(3, s, k[a:b], v[a:b]) for s, (a, b) in zip(slots, ctx.spans(), strict=True)]
    for (gk, gv), (wk, wv) in zip(got, want, strict=True):
        assert torch.equal(gk.cpu(), wk.cpu()) and torch.equal(gv.cpu(), wv.cpu())
    for slot, n, m in zip(slots, cached, lengths, strict=True):
        assert caches[0].length(3, slot) == caches[1].length(3, slot) == n + m
        rows = [c.rows(slot, 0, n + m) for c in caches]
        for a, b in ((caches[0].k, caches[1].k), (caches[0].v, caches[1].v)):
            flat = (a.shape[0], -1, *a.shape[3:])
            assert torch.equal(a.view(flat)[:, rows[0]].cpu().float(), b.view(flat)[:, rows[1]].cpu().float())


@pytest.mark.parametrize("dtype", ["auto", "fp8"])
def test_paged_prefill_attention_is_attend_over_each_whole_cache(dtype):
    """The paged cache's ``attend_step`` for a step with cached tokens (the paged prefill kernel over every
    row) against the CPU cache's (``attend`` over each sequence's whole k/v, causal from its cached length):
    continuing chunks longer than a program's tokens, a prefix longer than a key tile and spread over pages
    of 4 (tiles cross pages), single-row decodes and a fresh prompt in the same step, GQA groups of 4.
    Relative L2 < 2e-2 per sequence (bf16 probabilities into the value dot, fp32 softmax); the same pages
    and lengths as ``append`` would leave."""
    from fp4moe.engine.paged_cache import PagedKVCache

    gen = torch.Generator().manual_seed(16)
    h, hkv, d = 8, 2, 32
    paged = PagedKVCache([3], 256, 4, hkv, d, 6, 512, dtype, BF16, DEV)
    cpu = KVCache(dtype)
    history = {5: 130, 1: 3, 4: 70}  # slot -> tokens already cached
    for slot, n in history.items():
        k, v = (torch.randn(n, hkv, d, generator=gen).to(BF16) for _ in range(2))
        paged.append(3, slot, k.to(DEV), v.to(DEV))
        cpu.append(3, slot, k, v)
    slots, lengths = [0, 5, 1, 4], [9, 37, 1, 1]
    cached = [history.get(s, 0) for s in slots]
    q = torch.randn(sum(lengths), h, d, generator=gen).to(BF16)
    k, v = (torch.randn(sum(lengths), hkv, d, generator=gen).to(BF16) for _ in range(2))
    got = paged.attend_step(
        3, StepContext(lengths, cached, slots, paged, None), q.to(DEV), k.to(DEV), v.to(DEV)
    )
    ctx = StepContext(lengths, cached, slots, cpu, None)
    want = cpu.attend_step(3, ctx, q, k, v)
    for i, (a, b) in enumerate(ctx.spans()):
        assert rel(got[a:b].cpu(), want[a:b]) < RTOL, i
    for slot, n, m in zip(slots, cached, lengths, strict=True):
        assert paged.length(3, slot) == cpu.length(3, slot) == n + m
