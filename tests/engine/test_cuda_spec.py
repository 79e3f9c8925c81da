"""Speculative decoding on the GPU runner: MTP drafts on the fused rows, the fused verification round (greedy
tokens and sampling), the back-off of a rejected head, top-p sequences beside speculating ones, plain steps
under load. Agreement as in test_cuda_runner.py (greedy tokens up to the reference's near ties no wider than
the measured drift: ``runner_cases._agree``)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from runner_cases import DECODE, DEV, GPU, PROMPTS, _agree, _all_pages_back, _emulate_graphs, _fused  # noqa: E402

from fp4moe.engine.front.llm import LLM  # noqa: E402
from fp4moe.engine.request.sampler import SamplingParams  # noqa: E402


def test_speculation_through_the_gpu_runner_matches_plain_decoding(checkpoints):
    """Verification and rollback run the module path on the paged caches (state positions from the step)."""
    path = checkpoints.bf16()
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    ref = LLM(path, dtype="bfloat16", device="cpu").generate(prompts, params)
    llm = LLM(path, dtype="bfloat16", device=DEV, num_speculative_tokens=2)
    if DEV == "cpu":
        _fused(llm)
    _agree(ref, llm.generate(prompts, params))
    assert llm.speculator.stats.drafts > 0


def _greedy_pair(checkpoints, max_tokens: int):
    """Two greedy requests of ``max_tokens`` tokens, plain greedy decoding's outputs for them (the CPU, with
    logprobs for the near-tie rule) and an engine speculating 2 tokens through the fused round -> (prompts,
    params, reference outputs, engine)."""
    path = checkpoints.bf16()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": PROMPTS[0]}, {"prompt_token_ids": PROMPTS[2]}]
    ref = LLM(path, dtype="bfloat16", device="cpu").generate(
        prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=2)
    )
    llm = LLM(path, dtype="bfloat16", device=DEV, num_speculative_tokens=2)
    if DEV == "cpu":
        _fused(llm, spec_tokens=2)
    return prompts, params, ref, llm


def test_a_rejected_draft_head_stops_drafting_after_its_probe(checkpoints):
    """The tiny model's random MTP head: its drafts are almost never accepted, so after PROBE_ROUNDS fused
    rounds the sequence decodes plainly (not slower than without speculation, issue 20); the tokens stay
    plain greedy decoding's."""
    from fp4moe.engine.spec import spec_policy

    prompts, params, ref, llm = _greedy_pair(checkpoints, 14)
    spec, rounds = llm.speculator, []
    real_launch = spec.launch_round

    def launch_round(seqs, chained=False):  # every fused round, synchronous or run ahead
        rounds.append(len(seqs))
        return real_launch(seqs, chained)

    spec.launch_round = launch_round
    _agree(ref, llm.generate(prompts, params))
    assert spec.stats.accepted < 2 * spec_policy.MIN_ACCEPTED * spec_policy.PROBE_ROUNDS
    assert spec.stats.backed_off == 2 and rounds == [2] * spec_policy.PROBE_ROUNDS


@pytest.mark.parametrize("round_ms,loses", [(10.0, True), (0.9, False)])
def test_rounds_that_lose_to_plain_steps_at_their_batch_stop(checkpoints, monkeypatch, round_ms, loses):
    """The batch policy (``SpecCost``) with given times: plain steps of 2 ms, rounds of ``round_ms``. The
    per-sequence policy is switched off (every round "pays"), so the tiny model's rejected head appends one
    token a round. After a window of rounds the batch takes one plain step (its time was unknown); then
    1 / 10 ms loses to 1 / 2 ms and the batch decodes plainly from then on, while 1 / 0.9 ms pays and the
    rounds go on. The tokens stay plain greedy decoding's either way."""
    from contextlib import contextmanager

    from fp4moe.engine.spec import spec_cost, spec_policy
    from fp4moe.engine.spec.spec_cost import SpecCost

    monkeypatch.setattr(spec_policy, "MIN_ACCEPTED", 0.0)
    # windows of 4 rounds, not 8: every round runs Triton's interpreter (12 tokens where 16 were)
    monkeypatch.setattr(spec_cost, "WINDOW", 4)
    WINDOW = spec_cost.WINDOW
    prompts, params, ref, llm = _greedy_pair(checkpoints, 12)
    spec = llm.speculator
    spec.policy.cost, times, kinds = SpecCost(True), {"round": round_ms, "plain": 2.0}, []

    @contextmanager
    def timed(kind, n):
        yield
        kinds.append(kind)
        spec.policy.cost.add(kind, n, times[kind])

    spec.policy.cost.timed = timed
    _agree(ref, llm.generate(prompts, params))
    rounds = [i for i, k in enumerate(kinds) if k == "round"]
    # the probe after a window of rounds (and the round launched ahead of the window's last tokens: async
    # scheduling), and the judging after the next round
    ahead = (WINDOW, WINDOW + 1)
    assert spec.stats.plain_probes == 1 and kinds[: kinds.index("plain")].count("round") in ahead
    if loses:
        # (the probe's window, the round that judged, and at most one more launched ahead of its tokens)
        assert spec.stats.batch_backoffs == 1 and WINDOW + 1 <= len(rounds) <= WINDOW + 3
        assert set(kinds[rounds[-1] + 1 :]) == {"plain"} and len(kinds) - rounds[-1] > 2  # plain from then on
    else:
        assert spec.stats.batch_backoffs == 0 and kinds.count("plain") == 1 and len(rounds) > WINDOW + 1


@pytest.mark.parametrize("graphs", [False, True])
def test_first_drafts_on_the_fused_mtp_rows_are_the_module_paths(checkpoints, graphs):
    """A greedy request's first drafts (after its prompt) come from the fused MTP rows: the head catches up
    on the whole prompt, only each sequence's last row on through the MoE -- eagerly, or replaying the graph
    of the prompts' bucket (``FirstDrafts``; emulated on the CPU), padded rows and a padded sequence writing
    only the scratch slot. They are the module path's drafts up to a near tie of its draft logits (both bf16,
    summed in other orders: the measured decode drift's tie, ``runner_cases.DECODE``), and the head's cache and inputs end where the
    module path leaves them."""
    from fp4moe.engine.loop.scheduler import SchedulerConfig

    llm = LLM(checkpoints.bf16(), dtype="bfloat16", device=DEV, num_speculative_tokens=2)
    if DEV == "cpu":
        _fused(llm, spec_tokens=2)
    spec, kv, states = llm.speculator, llm.runner.kv, llm.runner.states
    core = llm.new_core(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256))
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    seqs = [llm.make_sequences({"prompt_token_ids": p}, greedy)[0] for p in PROMPTS]
    core.add(seqs)
    core.step()  # the prompts, and each one's first token
    assert all(len(s.output_ids) == 1 and s.drafts is None for s in seqs)
    inputs = [(s.mtp_cached, s.hidden_tail.clone()) for s in seqs]
    module = spec._mtp_drafts_many(seqs, kv, states)
    for s, (cached, tail) in zip(seqs, inputs, strict=True):
        s.mtp_cached, s.hidden_tail = cached, tail
    if graphs and DEV == "cpu":
        _emulate_graphs(llm.runner)
    llm.runner.cuda_graphs = graphs
    replays = []
    replay = llm.runner.first_drafts.replay
    llm.runner.first_drafts.replay = lambda *a: replays.append(a[2]) or replay(*a)
    fused = spec._first_drafts(seqs, kv)
    assert replays == ([(4, 96)] if graphs else [])  # 3 prompts of up to 70 tokens: the 4 x 96 prefill graph
    compared = 0
    for (drafts, logits), got in zip(module, fused, strict=True):
        for want, row, token in zip(drafts, logits, got, strict=True):
            if token != want:  # a later draft follows another token: the comparison ends here
                logprobs = torch.log_softmax(row.float(), -1)
                tie = (GPU if DEV == "cuda" else DECODE)["tie"]
                assert logprobs[want] - logprobs[token] < tie, (drafts, got)
                break
            compared += 1
    print(f"{compared} of {2 * len(seqs)} drafts compared")
    assert compared >= len(seqs)
    mtp = llm.model.mtp.layer_id
    for s in seqs:
        p = s.num_tokens - 1
        assert s.mtp_cached == p and len(s.hidden_tail) == 0 and kv.length(mtp, s.slot) == p
        core.abort(s)
    assert _all_pages_back(llm.runner)


# "draft-vocab": the MTP head's own drafts from a 64-id draft vocabulary, on the GPU only (its logits are
# tests/engine/test_draft_vocab.py's on the CPU; the interpreter's round costs CI minutes)
@pytest.mark.parametrize(
    "drafts", ["mtp", "oracle", "second-wrong", "kv-fp8", pytest.param("draft-vocab", marks=pytest.mark.gpu)]
)
def test_fused_speculative_round_gives_plain_greedy_tokens(checkpoints, drafts):
    """The fused greedy round (verify k+1 rows, accept, roll back from per-token states, draft the next
    round): with the MTP head's own drafts (the random head's are mostly rejected), with drafts that are
    the true continuation (all accepted), and with the second draft always wrong (one accepted, then
    rollback); the output is plain greedy decoding's."""
    path = checkpoints.bf16()
    k = 2
    kv_dtype = "fp8" if drafts == "kv-fp8" else "auto"
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    ref_params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    ref = LLM(path, dtype="bfloat16", device="cpu", kv_cache_dtype=kv_dtype).generate(prompts, ref_params)
    truth = [o.outputs[0].token_ids for o in ref]
    # oracle drafts go in with each round's host inputs: synchronous rounds (with async scheduling the rounds
    # after the first run ahead, on the drafts the round before made on the GPU: the "mtp" runs check those)
    oracle = drafts in ("oracle", "second-wrong")
    llm = LLM(
        path, dtype="bfloat16", device=DEV, num_speculative_tokens=k, kv_cache_dtype=kv_dtype,
        async_scheduling=not oracle, speculative_draft_vocab=64 if drafts == "draft-vocab" else 0,
    )  # fmt: skip
    if DEV == "cpu":
        _fused(llm, kv_dtype, spec_tokens=k)
    spec = llm.speculator
    assert spec.fused is not None
    rounds, accepted = [], []  # (slot, pending position, drafts) of each oracle round; what each accepted
    if oracle:
        fused, lens = spec.fused, [len(p) for p in PROMPTS]
        launch = fused.launch

        def oracle_launch(slots, positions, tokens, deltas, sampling=None):  # sequence i sits in slot i
            for slot, p, row in zip(slots, positions, tokens, strict=True):
                cont = truth[slot][p - lens[slot] + 1 :] + [0] * k
                row[1:] = cont[:k]
                if drafts == "second-wrong":
                    row[2] = (row[2] + 1) % 100
                rounds.append((slot, p, list(row[1:])))
            return launch(slots, positions, tokens, deltas, sampling)

        fused.launch = oracle_launch
        record = spec.stats.record
        spec.stats.record = lambda drafted, a: accepted.append(a) or record(drafted, a)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    agree = _agree(ref, outs)
    stats = spec.stats
    assert stats.drafts > 0
    if oracle:
        # Greedy verification accepts a draft exactly when it and every draft before it are the engine's own
        # next tokens, so each round's count follows from the engine's output: exact on any device, however
        # the engine's tokens part from the CPU reference's (a split at a near tie makes the later oracle
        # drafts wrong for the engine's continuation, and their rounds accept less -- as they must)
        assert len(accepted) == len(rounds), (len(accepted), len(rounds))
        for (slot, p, guess), a in zip(rounds, accepted, strict=True):
            seq = PROMPTS[slot] + list(outs[slot])
            want = 0
            while want < k and p + 1 + want < len(seq) and guess[want] == seq[p + 1 + want]:
                want += 1
            if p + 1 + want < len(seq) or want == k:  # the engine's tokens decide the count
                assert a == want, (slot, p, guess, seq[p + 1 : p + 1 + k], a)
            else:  # past max_tokens: the output stops before the drafts do; what it shows was accepted
                assert a >= want, (slot, p, guess, a)
    if drafts == "oracle":  # every draft is the reference's continuation: all accepted while the tokens agree
        assert stats.accepted_per_position[1] > 0
        if agree.identical:
            assert stats.mean_acceptance_length > 2.5, (agree, stats.mean_acceptance_length)
    if drafts == "second-wrong":
        assert stats.accepted_per_position[1] == 0
        assert stats.accepted_per_position[0] > 0
    assert _all_pages_back(llm.runner)


@pytest.mark.parametrize("variant", ["sorted", "unsorted"])
def test_fused_speculative_round_samples(checkpoints, variant):
    """Sampled sequences take the fused round next to a greedy one (rejection sampling on the device, one
    graph variant with a sort for top-k/top-p, one without for temperature/min-p): a seeded run is
    reproducible; the greedy sequence keeps plain greedy tokens; temperature > 0 with a filter that keeps
    one token (top-k 1, min-p 1) gives greedy tokens too, here with drafts that are the true continuation
    (every one accepted: the sampled rows' bonus path); every token of a freely sampled sequence (the
    random MTP head's drafts, mostly rejected: residual draws) is one the target's filtered distribution at
    its position keeps."""
    from fp4moe.engine.request.sampler import filter_logits
    from fp4moe.engine.spec.cuda_spec import GREEDY, SAMPLED, SORTED
    from fp4moe.eval.quality import window_outputs

    path = checkpoints.bf16()
    k, n = 2, 5
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    greedy = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=2)
    ref_llm = LLM(path, dtype="bfloat16", device="cpu")
    ref = ref_llm.generate(prompts, greedy)
    truth = [o.outputs[0].token_ids for o in ref]
    if variant == "sorted":
        free, one = dict(temperature=1.0, top_k=3, top_p=0.9), dict(temperature=0.8, top_k=1)
    else:
        free, one = dict(temperature=0.3, min_p=0.5), dict(temperature=0.8, min_p=1.0)
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=n, ignore_eos=True, seed=7, **free),
        SamplingParams(max_tokens=n, ignore_eos=True, seed=3, **one),
    ]
    llm = LLM(path, dtype="bfloat16", device=DEV, num_speculative_tokens=k)
    if DEV == "cpu":
        _fused(llm, spec_tokens=k)
    spec, fused = llm.speculator, llm.speculator.fused
    spec.speculate_sorted_sampling = True  # (off by default: top-k/top-p sequences then decode plainly)
    modes, forward, stored, set_probs = [], fused.forward, [], fused.set_draft_probs
    fused.forward = lambda b, mode=GREEDY: modes.append(mode) or forward(b, mode)
    fused.set_draft_probs = lambda slots, *rest: stored.extend(slots) or set_probs(slots, *rest)

    launch, launch_chained = fused.launch, fused.launch_chained

    def oracle_launch(slots, positions, tokens, deltas, sampling=None):
        # sequence i sits in slot i; the third one's drafts are its true continuation (in the rounds that
        # take host inputs; rounds run ahead take the drafts the round before made)
        rounds.append(sampling is not None)
        for slot, p, row in zip(slots, positions, tokens, strict=True):
            if slot == 2:
                row[1:] = (truth[2][p - len(PROMPTS[2]) + 1 :] + [0] * k)[:k]
        return launch(slots, positions, tokens, deltas, sampling)

    def chained(slots, reach, sampling=None):
        rounds.append(sampling is not None)
        return launch_chained(slots, reach, sampling)

    rounds = []  # per round: whether a sampled sequence was in it
    fused.launch, fused.launch_chained = oracle_launch, chained
    # the same engine, the same seeds: the same arithmetic, the same tokens (checked once: the host's
    # generators feed both graph variants alike, and every run costs the interpreter minutes)
    runs = [
        [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        for _ in range(1 + (variant == "sorted"))
    ]
    assert runs[0] == runs[-1]
    got = runs[0]
    _agree([ref[0], ref[2]], [got[0], got[2]])
    want = SORTED if variant == "sorted" else SAMPLED
    assert sum(rounds) >= 2 * len(runs)  # >= 2 sampled rounds per run ...
    # ... in the graph variant that fits them (on the GPU the forwards ran once, to capture each variant)
    assert want in modes and set(modes) <= {GREEDY, want}
    assert DEV == "cpu" or {mode for _, mode in fused.graphs} == set(modes)
    assert sorted(set(stored)) == [1, 2]  # the module path's first drafts of the sampled sequences
    assert spec.stats.accepted_per_position[k - 1] > 0
    sampled = PROMPTS[1] + got[1]
    logprobs, _ = window_outputs(ref_llm, sampled)
    for i in range(len(PROMPTS[1]), len(sampled)):
        # kept by the filter on the reference's logits, or a near tie at its edge: kept once the token's logit
        # rises by compare's near-tie margin, 0.1 nats (the GPU's bf16 logits are not the CPU's: a token
        # 0.211 nats below the top, against min-p 0.5's edge at 0.3 ln 2 = 0.208, was drawn on the H200)
        raised = logprobs[i - 1].clone()
        raised[sampled[i]] += 0.1
        gap = float(logprobs[i - 1].max() - logprobs[i - 1][sampled[i]])
        assert filter_logits(raised, params[1])[sampled[i]] > float("-inf"), (
            f"token {i - len(PROMPTS[1])} ({sampled[i]}) is not one the filter keeps: {gap:.5f} nats below the"
            " most likely"
        )
    assert _all_pages_back(llm.runner)


def test_top_p_sequences_decode_plainly_next_to_speculating_ones(checkpoints):
    """By default a sampled sequence with top-p (whose fused round would sort every vocabulary row) takes
    the runner's fused plain step inside a speculative batch: it drafts nothing, keeps no MTP inputs, and
    its seeded tokens are those of the same request without speculation; the greedy sequence beside it
    speculates and keeps plain greedy tokens."""
    path = checkpoints.bf16()
    k, n = 2, 5
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:2]]
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=n, temperature=1.0, top_p=0.9, seed=11, ignore_eos=True),
    ]
    greedy_ref = LLM(path, dtype="bfloat16", device="cpu").generate(
        prompts[:1], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=2)
    )
    # synchronous steps: every sampling goes through sample_all, which records the logits (async scheduling
    # samples decode-only steps on the device, past it)
    plain = LLM(path, dtype="bfloat16", device=DEV, async_scheduling=False)
    if DEV == "cpu":
        _fused(plain)
    sampled_logits = {}  # run -> the top-p sequence's logits per step, as its sampler saw them

    def record(llm, run):
        sample_all = llm.sampler.sample_all  # every sampling goes through it

        def wrapped(results):
            for seq, logits in results:
                if seq.params.top_p < 1:
                    sampled_logits.setdefault(run, []).append(logits.float().cpu().clone())
            return sample_all(results)

        llm.sampler.sample_all = wrapped

    record(plain, "plain")
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    llm = LLM(path, dtype="bfloat16", device=DEV, num_speculative_tokens=k)
    if DEV == "cpu":
        _fused(llm, spec_tokens=k)
    spec, runner = llm.speculator, llm.runner
    steps, decode_step = [], runner.decode_step
    runner.decode_step = lambda seqs, **kw: (
        steps.append([s.params.top_p for s in seqs]) or decode_step(seqs, **kw)
    )
    seqs = []
    make = llm._make_sequences

    def keep(*args):
        encoded, made = make(*args)
        seqs.extend(made)
        return encoded, made

    llm._make_sequences = keep
    record(llm, "spec")
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    _agree(greedy_ref, got[:1])  # greedy: up to near ties (bf16 in another order)
    # the sampled sequence: the same seed draws the same tokens from the same logits; the plain step ran
    # it in a batch of two, the speculative batch's plain step alone (another GEMM shape), so the logits may
    # differ by bf16 noise -- and a draw may then fall on the other side of a boundary: the first token
    # that differs must come with logits that differ, and ends the comparison
    assert len(got[1]) == len(expected[1]) == n
    ref_logits, got_logits = sampled_logits["plain"], sampled_logits["spec"]
    assert len(ref_logits) == len(got_logits) == n
    for step, (a, b) in enumerate(zip(ref_logits, got_logits, strict=True)):
        assert float((a - b).abs().max()) < 0.1 * float(a.abs().max()), step  # bf16 noise, not a bug
        if got[1][step] != expected[1][step]:
            assert not torch.equal(a, b), f"step {step}: the same logits and seed drew another token"
            break
    assert steps and all(p == [0.9] for p in steps)  # only the top-p sequence took plain steps
    assert spec.stats.drafts > 0 and spec.stats.drafts == spec.stats.draft_tokens // k
    assert seqs[1].hidden_tail.shape[0] == 0  # no MTP inputs kept for a sequence that never drafts


def test_plain_steps_under_load_leave_the_mtp_cache_to_the_head(checkpoints):
    """Over --speculative-disable-by-batch-size the fused plain step runs (keeping the MTP head's inputs);
    it writes the target's keys/values only, so the MTP layer's cache length stays where the head's own
    catch-up left it (else the catch-up would write past it); once the batch shrinks, drafting resumes and
    the tokens are plain greedy decoding's."""
    from fp4moe.engine.loop.scheduler import SchedulerConfig

    path = checkpoints.bf16()
    lengths = (3, 6)
    ref = LLM(path, dtype="bfloat16", device="cpu")
    truth = [
        ref.generate(
            [{"prompt_token_ids": p}],
            SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=2),
        )[0]
        for p, n in zip(PROMPTS, lengths, strict=False)
    ]
    llm = LLM(
        path, dtype="bfloat16", device=DEV, num_speculative_tokens=2, speculative_disable_by_batch_size=1
    )
    if DEV == "cpu":
        _fused(llm, spec_tokens=2)
        llm.speculator.disable_by_batch_size = 1
    spec, kv = llm.speculator, llm.runner.kv
    mtp_layer = llm.model.mtp.layer_id
    plain, checked = spec.plain_steps, []

    def plain_steps(seqs, kv_, states):
        plain(seqs, kv_, states)
        for s in seqs:
            checked.append((kv.length(mtp_layer, s.slot), s.mtp_cached))

    spec.plain_steps = plain_steps
    core = llm.new_core(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64))
    seqs = [
        llm.make_sequences(
            {"prompt_token_ids": p}, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        )[0]
        for p, n in zip(PROMPTS, lengths, strict=False)
    ]
    core.add(seqs)
    for _ in range(100):
        if all(s.finished for s in seqs):
            break
        core.step()
    assert spec.stats.disabled_steps > 0 and spec.stats.drafts > 0  # paused under load, drafted when alone
    assert checked and all(length == cached for length, cached in checked), checked
    _agree(truth, [s.output_ids for s in seqs])
