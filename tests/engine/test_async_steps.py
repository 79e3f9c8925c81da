"""Async scheduling on the GPU runner (``EngineCore.step``): decode steps and speculative rounds launched
before the previous step's tokens are read back keep the synchronous schedule's tokens. Agreement as in
test_cuda_runner.py (greedy tokens up to the reference's near ties)."""

from __future__ import annotations

import collections

import pytest

pytest.importorskip("triton")

from runner_cases import DEV, PROMPTS, _agree, _all_pages_back, _fused  # noqa: E402

from fp4moe.engine.front.llm import LLM  # noqa: E402
from fp4moe.engine.request.sampler import SamplingParams  # noqa: E402


def test_async_scheduling_overlaps_decode_steps_and_keeps_the_tokens(checkpoints):
    """Async scheduling (``EngineCore.step``): decode-only steps launch before the previous step's tokens
    are read back, their inputs the device's sampled ids. Greedy tokens are the synchronous schedule's on
    the same runner (up to near ties: a wasted row changes a step's batch); a sequence that a stop token ends while its next row is already in flight gets no extra
    token; lengths hold for sampled (seeded) and penalized sequences (which keep steps synchronous while
    they run); an arrival and an abort mid-chain fall back to the synchronous schedule; every page comes
    back."""
    from types import SimpleNamespace

    from fp4moe.engine.loop.scheduler import SchedulerConfig
    from fp4moe.engine.request.sequence import FinishReason

    path = checkpoints.bf16()
    prompts = [[5, 17, 300, 2, 9], list(range(40, 70)), [7, 8], [11, 12, 13]]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    llm = LLM(path, dtype="bfloat16", device=DEV, async_scheduling=False)  # the reference: one step at a time
    if DEV == "cpu":
        _fused(llm)
    first = llm.generate([{"prompt_token_ids": prompts[1]}], greedy)[0].outputs[0].token_ids
    stop_token = first[2]
    ref_params = [greedy, SamplingParams(**{**vars(greedy), "stop_token_ids": [stop_token]}),
                  SamplingParams(**{**vars(greedy), "max_tokens": 3})]  # fmt: skip
    ref = llm.generate([{"prompt_token_ids": p} for p in prompts[:3]], ref_params)
    core = llm.new_core(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), async_scheduling=True)
    params = [SamplingParams(**{**vars(p), "logprobs": None}) for p in ref_params] + [
        SamplingParams(max_tokens=6, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, repetition_penalty=1.3),
    ]
    seqs = [
        llm.make_sequences({"prompt_token_ids": p}, q)[0]
        for p, q in zip(prompts[:3], params[:3], strict=True)
    ]
    sampled = llm.make_sequences({"prompt_token_ids": prompts[3]}, params[3])[0]
    penalized = llm.make_sequences({"prompt_token_ids": [3, 3, 4]}, params[4])[0]
    core.add(seqs + [penalized])
    tokens = collections.Counter()  # tokens handed out per sequence

    def step():
        for out in core.step():
            tokens[id(out.seq)] += out.new_tokens

    for _ in range(200):  # the penalized sequence keeps every step synchronous until it ends
        if penalized.finished:
            break
        assert core.stats.async_steps == 0
        step()
    step()
    step()
    assert core.stats.async_steps >= 1  # the chain started
    core.add([sampled])  # an arrival mid-chain: the step in flight completes, the prompt is scheduled
    for _ in range(200):
        if not core.has_work():
            break
        step()
    assert core.stats.async_steps >= 4
    got = [SimpleNamespace(outputs=[SimpleNamespace(token_ids=s.output_ids, logprobs=None)]) for s in seqs]
    _agree(ref, got)
    # the stop token ended it while its next row was in flight: nothing after the stop token
    assert stop_token not in seqs[1].output_ids[:-1]
    assert seqs[1].finish_reason == FinishReason.STOP or len(seqs[1].output_ids) == 8  # (or a near tie)
    for s in seqs + [sampled, penalized]:
        assert tokens[id(s)] == len(s.output_ids)  # every token handed out once, no wasted row's token
    assert [len(s.output_ids) for s in (seqs[0], seqs[2], sampled, penalized)] == [8, 3, 6, 4]
    assert _all_pages_back(llm.runner)

    # an abort while a step is in flight: the sequence gets nothing more, its caches come back
    a, b = (llm.make_sequences({"prompt_token_ids": p}, params[0])[0] for p in prompts[:2])
    core.add([a, b])
    while core.stats.async_steps < 8 or core._inflight is None:
        step()
    before = len(a.output_ids)
    core.abort(a)
    while core.has_work():
        step()
    assert len(a.output_ids) == before and len(b.output_ids) == 8 and tokens[id(b)] == 8
    assert _all_pages_back(llm.runner)

    # every slot taken and a request waiting: the steps keep overlapping until a slot frees
    full = llm.new_core(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64), async_scheduling=True)
    trio = [llm.make_sequences({"prompt_token_ids": p}, params[0])[0] for p in prompts[:3]]
    full.add(trio)
    overlapped_while_waiting = 0
    while full.has_work():
        waiting, before = bool(full.scheduler.waiting), full.stats.async_steps
        full.step()
        overlapped_while_waiting += waiting and full.stats.async_steps > before
    assert overlapped_while_waiting >= 3 and [len(s.output_ids) for s in trio] == [8, 8, 8]
    assert _all_pages_back(llm.runner)


def test_backed_off_speculation_decodes_through_async_steps(checkpoints, monkeypatch):
    """A sequence whose drafts are rejected (the tiny model's random MTP head) backs off after its probe
    rounds; its plain steps then take async scheduling (they cost what plain decoding costs, issue 20's
    "speculation that never loses"), keep the MTP head's inputs, and after the backoff it probes again
    with the head caught up. Greedy tokens are plain decoding's (verification keeps the target's tokens
    whatever the drafts; near ties excepted). A request that arrives while the head keeps failing starts
    backed off."""
    import fp4moe.engine.spec.spec_policy as spec_policy
    from fp4moe.engine.loop.scheduler import SchedulerConfig

    monkeypatch.setattr(spec_policy, "PROBE_ROUNDS", 2)  # short phases: every step runs Triton's interpreter
    monkeypatch.setattr(spec_policy, "BACKOFF_STEPS", 2)
    path = checkpoints.bf16()
    n = 8  # the first token, 2 probe rounds, 2 backed-off steps, probes again
    greedy = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:2]]
    plain = LLM(path, dtype="bfloat16", device=DEV, async_scheduling=False)
    if DEV == "cpu":
        _fused(plain)
    ref = plain.generate(prompts, greedy)
    llm = LLM(path, dtype="bfloat16", device=DEV, num_speculative_tokens=2)
    if DEV == "cpu":
        _fused(llm, spec_tokens=2)
    spec, probes = llm.speculator, []
    launch_round = spec.launch_round
    monkeypatch.setattr(
        spec,
        "launch_round",
        lambda seqs, chained=False: probes.append(len(seqs)) or launch_round(seqs, chained),
    )
    core = llm.new_core(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=128), async_scheduling=True)
    params = SamplingParams(**{**vars(greedy), "logprobs": None})
    seqs = [llm.make_sequences(p, params)[0] for p in prompts]
    core.add(seqs)
    rounds_before_async = None
    while core.has_work():
        core.step()
        plain_ahead = core._inflight is not None and not core._inflight.round
        if plain_ahead and rounds_before_async is None:
            rounds_before_async = len(probes)
    assert spec.stats.backed_off >= 2 and spec.stats.acceptance_rate < 0.3  # the random head
    assert rounds_before_async >= 2 and len(probes) > rounds_before_async  # probed again after the chain
    assert core.stats.async_steps >= 2  # backed-off steps after the first (which follows a synchronous round)
    from types import SimpleNamespace

    _agree(
        ref, [SimpleNamespace(outputs=[SimpleNamespace(token_ids=s.output_ids, logprobs=None)]) for s in seqs]
    )
    assert all(len(s.output_ids) == n for s in seqs)
    assert _all_pages_back(llm.runner)
    # a request arriving while the head keeps failing starts backed off: no probe rounds, async from its
    # first decode step
    assert not spec.policy.head_pays()
    monkeypatch.setattr(spec_policy, "BACKOFF_STEPS", 4)  # its 4 steps after the first token, all backed off
    late = llm.make_sequences(prompts[0], SamplingParams(**{**vars(params), "max_tokens": 5}))[0]
    core.add([late])
    probed, overlapped = len(probes), core.stats.async_steps
    while core.has_work():
        core.step()
    assert len(late.output_ids) == 5 and spec.stats.started_backed_off == 1
    assert len(probes) == probed and core.stats.async_steps >= overlapped + 3


def test_speculative_rounds_run_ahead_of_their_tokens(checkpoints, monkeypatch):
    """With async scheduling a fused round is launched before the tokens of the round in flight reach the
    host: each round leaves the next one's inputs (its final token, the drafts it made, the next position)
    on the GPU. With every draft forced accepted (a = k each round: the chain moves k + 1 positions a
    round), the tokens are exactly those of synchronous rounds (the same graphs on the same inputs); a stop
    token that ends a sequence while its next round is in flight drops that round's tokens, an abort
    likewise; every token is handed out once and every page comes back."""
    from fp4moe.engine.loop.scheduler import SchedulerConfig

    monkeypatch.setenv("FP4MOE_FORCE_ACCEPTANCE", "1.0")  # read when the speculator is built
    path, k, n = checkpoints.bf16(), 2, 8
    greedy = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)

    def engine(async_scheduling: bool) -> LLM:
        llm = LLM(
            path, dtype="bfloat16", device=DEV, num_speculative_tokens=k, async_scheduling=async_scheduling
        )
        if DEV == "cpu":
            _fused(llm, spec_tokens=k)
        return llm

    def run(llm, params, abort_at=None):
        """The prompts through an engine core -> each sequence's tokens; checks that each token was handed
        out once and every page came back. ``abort_at``: the last sequence is aborted once it holds that
        many tokens, a round in flight."""
        core = llm.new_core(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=128))
        seqs = [
            llm.make_sequences({"prompt_token_ids": p}, q)[0] for p, q in zip(PROMPTS, params, strict=True)
        ]
        core.add(seqs)
        handed = collections.Counter()
        while core.has_work():
            for out in core.step():
                handed[id(out.seq)] += out.new_tokens
            last = seqs[-1]
            if (
                abort_at
                and len(last.output_ids) >= abort_at
                and any(s is last for s in core.scheduler.running)
            ):
                assert core._inflight is not None and core._inflight.round
                core.abort(last)
        assert [handed[id(s)] for s in seqs] == [len(s.output_ids) for s in seqs]
        assert _all_pages_back(llm.runner)
        return [s.output_ids for s in seqs], core

    ref, _ = run(engine(False), [greedy] * 3)
    assert [len(t) for t in ref] == [n] * 3
    llm = engine(True)
    chained = []
    launch_chained = llm.speculator.fused.launch_chained
    llm.speculator.fused.launch_chained = lambda *args: chained.append(1) or launch_chained(*args)
    got, core = run(llm, [greedy] * 3)
    assert got == ref
    # 1 token from the prompt, then rounds of 3: the first drafts on the module path (synchronous), the
    # second is launched ahead, the third chains (the round after it could end the sequences by length, so
    # the chain stops: a fourth, synchronous round appends the 8th token and ends them)
    assert len(chained) == 1 and core.stats.async_steps == 2
    assert llm.speculator.stats.mean_acceptance_length == k + 1

    # the second sequence's 7th token stops it, and the third is aborted at 7 tokens: the round that made
    # them (tokens 5-7) is read back while the next one, of all three, is in flight
    stop = ref[1][6]
    assert stop not in ref[1][:6]
    got, _ = run(
        llm, [greedy, SamplingParams(**{**vars(greedy), "stop_token_ids": [stop]}), greedy], abort_at=7
    )
    assert got[1:] == [ref[1][:7], ref[2][:7]]
    assert len(got[0]) == n and got[0][:7] == ref[0][:7]  # later rounds ran at another batch size
