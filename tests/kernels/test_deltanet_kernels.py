"""The Gated DeltaNet kernels (causal conv, gated norm, the decode and verify recurrences, varlen prefill, the
slot states' gather/scatter) against the torch layer, step by step and sequence by sequence. Tolerances
(kernel_refs.py): relative L2 error 2e-2 for bf16 outputs; integer outputs exact."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_refs import BF16, DEV, RTOL, rel  # noqa: E402

from fp4moe.engine.reference.cache import DeltaNetStates, KVCache  # noqa: E402
from fp4moe.engine.reference.context import StepContext  # noqa: E402
from fp4moe.kernels import gdn_decode as gdn_k  # noqa: E402
from fp4moe.layers.deltanet import GatedDeltaNet  # noqa: E402


def _gdn_layer(gen, hk=2, hv=4, dk=16, dv=32, hidden=64):
    layer = GatedDeltaNet(hidden, hk, hv, dk, dv, 4, 1e-6, layer_id=0)
    for p in layer.parameters():
        p.data = (torch.randn(p.shape, generator=gen) * 0.2).to(BF16)
    layer.A_log.data = torch.rand(hv, generator=gen).log().float()
    layer.dt_bias.data = torch.rand(hv, generator=gen).float()
    return layer.to(DEV)


@pytest.fixture(params=["taps", "window"])
def conv_kernel(request, monkeypatch):
    """Each conv test on both prefill conv kernels: the taps kernel and the sliding window (``causal_conv.WINDOW``)."""
    from fp4moe.kernels import causal_conv

    monkeypatch.setattr(causal_conv, "WINDOW", request.param == "window")
    return request.param


@pytest.mark.parametrize("n", [2, 3, 37, 100])
def test_causal_conv_matches_the_layers_conv(n, conv_kernel):
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
            after = history[i * t + j] if j < t - 1 else state[slot]  # the last token's: in the slot
            assert rel(after, states.get(0, slot)[1]) < 1e-2, (i, j)
        states.restore(slot, before)  # the reference keeps only the accepted tokens
        for j in range(accepted[i] + 1):
            reference(x[i * t + j], p + j, i)
    rec = state[None]
    accepted_t = torch.tensor(accepted, device=DEV)
    gdn_k.restore_states(history[None], rec, accepted_t, torch.tensor(slots, device=DEV), t, kernel=True)
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


def _varlen_rows(gen, lengths, width):
    """Flat rows of several sequences and their layout (StepContext's device tensors)."""
    x = torch.randn(sum(lengths), width + 8, generator=gen).to(BF16)[:, :width]  # strided, as in_proj's
    ctx = StepContext(list(lengths), [0] * len(lengths), list(range(len(lengths))), KVCache(), None)
    return x, ctx


def test_causal_conv_varlen_is_each_sequence_alone(conv_kernel):
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


@pytest.mark.parametrize("k_dim", [16, 24])
def test_causal_conv_planar_parts_are_the_row_major_outputs_columns(k_dim, conv_kernel):
    """``parts``: q, k and v each one contiguous block of the same values (exactly: same sums, another
    layout), for a single sequence and the varlen launch -- 128 channels, and 160 (not a whole number of the
    kernel's 128-channel blocks); a split past the channels is refused."""
    from fp4moe.kernels.causal_conv import causal_conv_silu, causal_conv_silu_varlen

    gen = torch.Generator().manual_seed(13)
    layer = GatedDeltaNet(64, 2, 4, k_dim, 16, 4, 1e-6, 0)
    layer.conv1d_weight.data = (torch.randn(layer.conv_dim, 1, 4, generator=gen) * 0.5).to(BF16)
    w = layer.conv1d_weight.to(DEV)
    lengths = [3, 40, 70]
    x, ctx = _varlen_rows(gen, lengths, layer.conv_dim)
    states = torch.randn(len(lengths), layer.conv_dim, 3, generator=gen).to(BF16)
    t = ctx.tensors(DEV)
    whole, _ = causal_conv_silu_varlen(x.to(DEV), states.to(DEV), w, t.token_seq, t.starts, t.ends)
    parts, _ = causal_conv_silu_varlen(
        x.to(DEV), states.to(DEV), w, t.token_seq, t.starts, t.ends, layer.parts()
    )
    one, _ = causal_conv_silu(x[:3].to(DEV), states[0].to(DEV), w)
    one_parts, _ = causal_conv_silu(x[:3].to(DEV), states[0].to(DEV), w, layer.parts())
    for ref, got in ((whole, parts), (one, one_parts)):
        assert all(p.is_contiguous() for p in got)
        for r, g in zip(layer.split_qkv(ref), got, strict=True):
            assert torch.equal(r.cpu(), g.cpu())
    with pytest.raises(ValueError, match="do not split"):
        causal_conv_silu(x[:3].to(DEV), states[0].to(DEV), w, (32, layer.conv_dim + 1))


@pytest.mark.parametrize("k_dim,hk", [(16, 2), (128, 1)])
def test_causal_conv_normalises_q_and_k_as_fla_does(k_dim, hk, conv_kernel):
    """``norm``: q's and k's heads L2-normalised in the conv kernel as fla's ``l2norm_fwd`` would normalise the
    planar output (x / sqrt(sum x^2 + 1e-6) in fp32 from the bf16 values, rounded to bf16), v as it was; heads
    of 16 channels (several a program) and of 128 (one a program, the model's). Another summation order: an
    element may differ by one bf16 step, rarely. A head width the kernel cannot group is refused."""
    from fp4moe.kernels.causal_conv import causal_conv_silu, causal_conv_silu_varlen

    gen = torch.Generator().manual_seed(k_dim)
    layer = GatedDeltaNet(64, hk, 2 * hk, k_dim, 16, 4, 1e-6, 0)
    layer.conv1d_weight.data = (torch.randn(layer.conv_dim, 1, 4, generator=gen) * 0.5).to(BF16)
    w = layer.conv1d_weight.to(DEV)
    lengths = [3, 40]
    x, ctx = _varlen_rows(gen, lengths, layer.conv_dim)
    states = torch.randn(len(lengths), layer.conv_dim, 3, generator=gen).to(BF16).to(DEV)
    t = ctx.tensors(DEV)
    plain, _ = causal_conv_silu_varlen(x.to(DEV), states, w, t.token_seq, t.starts, t.ends, layer.parts())
    normed, _ = causal_conv_silu_varlen(
        x.to(DEV), states, w, t.token_seq, t.starts, t.ends, layer.parts(), k_dim
    )
    one, _ = causal_conv_silu(x[:3].to(DEV), states[0], w, layer.parts(), k_dim)
    assert all(torch.equal(a.cpu(), b.cpu()[:3]) for a, b in zip(one, normed, strict=True))
    for got, y in zip(normed[:2], plain[:2], strict=True):
        heads = y.cpu().float().view(y.shape[0], -1, k_dim)
        want = (heads * (1 / torch.sqrt((heads * heads).sum(-1, keepdim=True) + 1e-6))).to(BF16)
        want = want.view(y.shape)
        diff = (got.cpu().float() - want.float()).abs()
        assert float(diff.max()) <= 2**-8  # unit vectors: one bf16 step below 1 is 2^-8
        assert float((diff > 0).float().mean()) < 0.01
    assert torch.equal(normed[2].cpu(), plain[2].cpu())
    with pytest.raises(ValueError, match="cannot normalise"):
        causal_conv_silu(x[:3].to(DEV), states[0], w, layer.parts(), 24)


def test_slot_states_gather_and_scatter_are_get_and_set():
    """The GPU states' batched read/write of a step against the per-slot get/set: exact (copies), stale
    ring entries and states of a fresh sequence read as zeros, positions wrap around the ring."""
    from fp4moe.engine.runner.paged_cache import SlotStates

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
    from fp4moe.engine.runner.paged_cache import SlotStates
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


@pytest.mark.parametrize("t", [2, 3, 4])
def test_restore_states_copies_the_accepted_state_where_drafts_were_rejected(t):
    """The rollback kernel against its torch reference, exactly (a copy): several layers, sequences whose
    slots are out of order, every accepted count (the ones that accepted all drafts keep their slot's
    state), states whose size is not a multiple of the kernel's block, and a history with more rows than
    the round uses (the runner's is sized for its largest batch)."""
    gen = torch.Generator().manual_seed(t)
    layers, b, slots_n = 3, 5, 7
    history = torch.randn(layers, (b + 2) * t, 2, 3, 700, generator=gen).to(DEV)
    state = torch.randn(layers, slots_n, 2, 3, 700, generator=gen).to(DEV)
    accepted = torch.tensor([i % t for i in range(b)], device=DEV)
    slots = torch.tensor([6, 0, 3, 2, 5], dtype=torch.int32, device=DEV)
    before = state.clone()
    want = state.clone()
    gdn_k.restore_states_reference(history, want, accepted, slots, t)
    gdn_k.restore_states(history, state, accepted, slots, t, kernel=True)
    assert torch.equal(state, want)
    for i, slot in enumerate(
        slots.tolist()
    ):  # the reference itself: restored, or kept where all were accepted
        a = i % t
        assert torch.equal(want[:, slot], before[:, slot] if a == t - 1 else history[:, i * t + a]), i
    untouched = [s for s in range(slots_n) if s not in slots.tolist()]
    assert torch.equal(state[:, untouched], before[:, untouched])


@pytest.mark.parametrize("norm", [0, 128])
def test_window_conv_gives_the_taps_kernels_outputs(norm, monkeypatch):
    """The sliding-window conv kernel against the taps kernel on a wide conv (channels past one 1,024-channel
    block and not a whole number of them, the model's q/k/v split at 1,024 / 2,048, heads of 128): the same
    sums in the same order, so the same bits -- for sequences that start inside a block of rows (the state's
    taps) and for blocks inside one sequence (the window's fast path). On the GPU the heads' L2 norm sums
    each head's squares in the order of each kernel's layout: a normalised element may differ by a bf16 step
    (under the interpreter numpy sums both alike)."""
    from fp4moe.kernels import causal_conv

    gen = torch.Generator().manual_seed(17 + norm)
    channels, parts = 3 * 1024 + 512, (1024, 2048)
    w = (torch.randn(channels, 1, 4, generator=gen) * 0.5).to(BF16).to(DEV)
    lengths = [5, 40, 21]
    x, ctx = _varlen_rows(gen, lengths, channels)
    states = torch.randn(len(lengths), channels, 3, generator=gen).to(BF16).to(DEV)
    t = ctx.tensors(DEV)
    outs = []
    for window in (False, True):
        monkeypatch.setattr(causal_conv, "WINDOW", window)
        got, new = causal_conv.causal_conv_silu_varlen(
            x.to(DEV), states, w, t.token_seq, t.starts, t.ends, parts, norm
        )
        alone, _ = causal_conv.causal_conv_silu(x[5:45].to(DEV), states[1], w, parts, norm)
        outs.append((got, new, alone))
    for a, b in zip(outs[0], outs[1], strict=True):
        for u, v in zip(
            a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,), strict=True
        ):
            if norm and DEV.type == "cuda":
                diff = (u.float() - v.float()).abs()
                assert float(diff.max()) <= 2**-8 and float((diff > 0).float().mean()) < 1e-3
            else:
                assert torch.equal(u.cpu(), v.cpu())
