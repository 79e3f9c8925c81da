"""MTP speculative decoding: lossless under greedy for every k, with drafts accepted, partly accepted or
always rejected (rollback); the sampled distribution equals plain sampling; a clear error without MTP."""

import collections
import re

import pytest
import torch

from fp4moe.engine.front.llm import LLM
from fp4moe.engine.request.sampler import SamplingParams
from fp4moe.models.tiny import CheckpointLayout, TinySpec

PROMPTS = ["Hello there", "The Python tutorial " * 10, [5, 6, 7]]
GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def path(checkpoints):
    return checkpoints.bf16(
        CheckpointLayout.QWEN3_6
    )  # fused MTP experts; QWEN3_5 (per-expert) loads the same way


@pytest.fixture(scope="module")
def reference(path):
    return [o.outputs[0].token_ids for o in LLM(path, dtype="float32").generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_is_identical_with_the_mtp_head(path, reference, k):
    llm = LLM(path, dtype="float32", num_speculative_tokens=k)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
    assert llm.speculator.stats.draft_tokens > 0


def test_greedy_is_identical_with_a_draft_vocabulary(path, reference):
    """Drafts from 64 of the 1,024 ids (the lowest and the special ones): fewer accepted, the same tokens."""
    llm = LLM(path, dtype="float32", num_speculative_tokens=2, speculative_draft_vocab=64)
    ids = set(llm.model.mtp.draft_ids.tolist())
    assert 64 <= len(ids) < llm.model.args.vocab_size and set(range(64)) <= ids and llm.prompts.eos_ids <= ids
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
    assert llm.speculator.stats.draft_tokens > 0


def _oracle(llm, reference, corrupt_at=None):
    """A drafter that proposes the true continuation (optionally wrong at one draft position)."""
    by_prompt = {}

    def drafter(seq, kv, states):
        key = tuple(seq.prompt_ids)
        ref = by_prompt[key]
        start = len(seq.output_ids)
        drafts = list(ref[start : start + llm.speculator.k])
        drafts += [0] * (llm.speculator.k - len(drafts))
        if corrupt_at is not None and corrupt_at < len(drafts):
            drafts[corrupt_at] = (drafts[corrupt_at] + 1) % 1000
        return drafts, [torch.zeros(llm.model.args.vocab_size)] * len(drafts)

    for prompt, ref in zip(PROMPTS, reference, strict=True):
        _, seqs = llm._make_sequences([prompt], [GREEDY])
        by_prompt[tuple(seqs[0].prompt_ids)] = ref
    return drafter


@pytest.mark.parametrize(("corrupt_at", "accepted_min"), [(None, 0.9), (1, 0.3), (0, 0.0)])
def test_accept_partial_and_full_rollback(path, reference, corrupt_at, accepted_min):
    llm = LLM(path, dtype="float32", num_speculative_tokens=3)
    llm.speculator.drafter = _oracle(llm, reference, corrupt_at)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert got == reference  # whatever is accepted or rolled back, the output is the target's
    stats = llm.speculator.stats
    assert stats.acceptance_rate >= accepted_min
    if corrupt_at == 0:
        assert stats.accepted == 0  # rejected at every position: every step rolled back
    if corrupt_at == 1:
        assert stats.accepted_per_position[1] == 0 and stats.accepted_per_position[0] > 0
    if corrupt_at is None:
        assert stats.mean_acceptance_length > 3.0


def test_rejection_sampling_reproduces_the_target_distribution(path):
    """The verify rule on synthetic target/draft distributions over 6 tokens: the first emitted token is
    distributed as the target's p (20,000 trials; total variation < 0.02, sampling noise ~0.006), and drafts
    are accepted at the theoretical rate sum(min(p, q))."""
    from fp4moe.engine.request.sequence import Sequence

    llm = LLM(path, dtype="float32", num_speculative_tokens=1)
    spec = llm.speculator
    target_logits = torch.full((1000,), -1e9)
    draft_logits = torch.full((1000,), -1e9)
    target_logits[:6] = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 1.5])
    draft_logits[:6] = torch.tensor([0.0, 2.0, 0.5, 1.0, 0.0, -2.0])
    p, q = target_logits.softmax(-1)[:6], draft_logits.softmax(-1)[:6]
    seq = Sequence(0, [1, 2, 3], SamplingParams(temperature=1.0, seed=0), slot=0)
    counts, accepted = torch.zeros(6), 0
    trials = 20_000
    for _ in range(trials):
        d = int(torch.multinomial(q, 1, generator=seq.generator))
        out = spec._verify(seq, [d], [draft_logits], torch.stack([target_logits, target_logits]))
        counts[out[0]] += 1
        accepted += len(out) == 2
    assert 0.5 * (counts / trials - p).abs().sum() < 0.02
    assert abs(accepted / trials - torch.minimum(p, q).sum()) < 0.02


@pytest.mark.parametrize("draft_vocab", [0, 64])
def test_sampling_end_to_end_matches_plain_sampling(path, draft_vocab):
    """Sampled generation with the MTP head: the 2nd token's distribution equals plain sampling's, also with
    the drafts from a draft vocabulary (their distributions zero outside it)."""
    params = dict(max_tokens=2, temperature=1.0, top_k=4, ignore_eos=True)
    plain = LLM(path, dtype="float32")
    spec = LLM(path, dtype="float32", num_speculative_tokens=2, speculative_draft_vocab=draft_vocab)
    counts = {"plain": collections.Counter(), "spec": collections.Counter()}
    n = 300
    for seed in range(n):
        p = SamplingParams(seed=seed, **params)
        counts["plain"][plain.generate([[5, 6, 7]], p)[0].outputs[0].token_ids[1]] += 1
        counts["spec"][spec.generate([[5, 6, 7]], p)[0].outputs[0].token_ids[1]] += 1
    keys = set(counts["plain"]) | set(counts["spec"])
    tv = 0.5 * sum(abs(counts["plain"][k] - counts["spec"][k]) for k in keys) / n
    assert spec.speculator.stats.draft_tokens > 0
    assert tv < 0.2, tv  # ~16 outcomes at n=300: noise ~0.1


def test_no_mtp_head_is_a_clear_error(checkpoints):
    path = checkpoints.bf16(CheckpointLayout.QWEN3_5, TinySpec(with_mtp=False))
    # the message names the checkpoint and the way out
    with pytest.raises(
        ValueError, match=rf"^{re.escape(str(path))} has no MTP head.*num_speculative_tokens=0"
    ):
        LLM(path, num_speculative_tokens=2)
    # ... and the way out works: the same checkpoint generates without speculation
    llm = LLM(path, dtype="float32")
    assert llm.speculator is None and llm.model.mtp is None
    assert len(llm.generate([[5, 6, 7]], GREEDY)[0].outputs[0].token_ids) == GREEDY.max_tokens


def test_continuous_batching_with_speculation_matches_sequential(path, reference):
    from fp4moe.engine.loop.scheduler import SchedulerConfig

    for drafter in ("mtp", "oracle"):
        llm = LLM(path, dtype="float32", num_speculative_tokens=2)
        if drafter == "oracle":
            llm.speculator.drafter = _oracle(llm, reference)
        core = llm.new_core(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16))
        seqs = [llm.make_sequences(p, GREEDY)[0] for p in PROMPTS]
        core.add(seqs)
        for _ in range(200):
            if all(s.finished for s in seqs):
                break
            core.step()
        assert [s.output_ids for s in seqs] == reference, drafter
        assert core.kv._kv == {} and core.states._states == {}
        if drafter == "oracle":
            assert llm.speculator.stats.accepted > 0 and core.stats.steps < 40  # several tokens per step


def test_speculation_with_prefix_caching_and_fp8_kv(path, reference):
    from fp4moe.engine.loop.prefix_cache import PrefixCache
    from fp4moe.engine.loop.scheduler import SchedulerConfig

    def serve(llm, prompts, prefix_cache=None):
        core = llm.new_core(
            SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=32), prefix_cache=prefix_cache
        )
        outs = []
        for prompt in prompts:  # one after the other, so later ones can hit the prefix cache
            seq = llm.make_sequences(prompt, GREEDY)[0]
            core.add([seq])
            while not seq.finished:
                core.step()
            outs.append(seq.output_ids)
        return outs, core

    llm = LLM(path, dtype="float32", num_speculative_tokens=2)
    llm.speculator.drafter = _oracle(llm, reference)
    pc = PrefixCache(block_size=8)
    outs, _ = serve(llm, [PROMPTS[1], PROMPTS[1], PROMPTS[0]], pc)
    assert outs == [reference[1], reference[1], reference[0]] and pc.hits > 0
    fp8_plain = [
        o.outputs[0].token_ids
        for o in LLM(path, dtype="float32", kv_cache_dtype="fp8").generate(PROMPTS, GREEDY)
    ]
    fp8_spec = LLM(path, dtype="float32", kv_cache_dtype="fp8", num_speculative_tokens=2)
    assert [o.outputs[0].token_ids for o in fp8_spec.generate(PROMPTS, GREEDY)] == fp8_plain


def test_speculation_pauses_under_load_and_resumes(path, reference, monkeypatch):
    """More decoding sequences than --speculative-disable-by-batch-size: batched plain steps (no drafts);
    once the batch shrinks, drafting resumes with the MTP head caught up -- tokens equal plain decoding.
    Prompts and plain steps take the runner's own step (``run``, one loop with plain decoding's): no
    forward of the runner outside it."""
    from fp4moe.engine.loop.scheduler import SchedulerConfig

    llm = LLM(path, dtype="float32", num_speculative_tokens=2, speculative_disable_by_batch_size=1)
    llm.speculator.drafter = _oracle(llm, reference)
    runner, depth, calls = llm.runner, [0], collections.Counter()
    run, forward = runner.run, runner.forward

    def counted_run(*args, **kwargs):
        calls["run"] += 1
        depth[0] += 1
        try:
            return run(*args, **kwargs)
        finally:
            depth[0] -= 1

    def counted_forward(*args, **kwargs):
        calls["forward outside run"] += depth[0] == 0
        return forward(*args, **kwargs)

    monkeypatch.setattr(runner, "run", counted_run)
    monkeypatch.setattr(runner, "forward", counted_forward)
    core = llm.new_core(SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=64))
    seqs = [llm.make_sequences(p, GREEDY)[0] for p in PROMPTS]
    core.add(seqs[:2])
    for _ in range(3):
        core.step()
    core.add(seqs[2:])
    for _ in range(200):
        if all(s.finished for s in seqs):
            break
        core.step()
    stats = llm.speculator.stats
    assert [s.output_ids for s in seqs] == reference
    assert stats.disabled_steps > 0 and stats.accepted > 0  # paused under load, drafted when alone
    assert calls["run"] >= stats.disabled_steps and calls["forward outside run"] == 0


def test_batched_mtp_drafts_equal_per_sequence_drafts(path):
    """Drafting several sequences in one flat MTP forward proposes what drafting each alone does."""
    llm = LLM(path, dtype="float32", num_speculative_tokens=3)
    spec = llm.speculator
    _, seqs = llm._make_sequences(PROMPTS, [GREEDY] * len(PROMPTS))
    for slot, seq in enumerate(seqs):
        seq.slot = slot
    kv, states = llm.runner.new_caches()
    spec.prefill([(s, len(s.all_ids)) for s in seqs], kv, states)
    saved = [s.mtp_cached for s in seqs]
    many = spec._mtp_drafts_many(seqs, kv, states)
    for seq, cached in zip(seqs, saved, strict=True):  # undo the catch-up, then draft one by one
        seq.mtp_cached = cached
        kv.truncate(llm.model.mtp.layer_id, seq.slot, cached)
    one = [spec._mtp_drafts(seq, kv, states) for seq in seqs]
    assert [d for d, _ in many] == [d for d, _ in one]
    for (_, a), (_, b) in zip(many, one, strict=True):
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)


def test_forget_drops_the_counts_and_the_rounds_that_judge_new_requests(path):
    """``MTPSpeculator.forget`` (after the server's warm-up, whose sampled rounds on a random head accepted
    most drafts): the counts restart and a new request is judged on served rounds only."""
    llm = LLM(path, dtype="bfloat16", num_speculative_tokens=2)
    spec = llm.speculator
    llm.generate([[5, 6, 7]], GREEDY)
    assert spec.stats.drafts > 0 and spec.policy.recent
    spec.policy.recent.extend([2] * 64)  # rounds that paid
    assert spec.policy.head_pays()
    spec.forget()
    assert spec.stats.drafts == 0 and spec.stats.accepted_per_position == [0, 0] and not spec.policy.recent
