"""Continuous batching, chunked prefill and preemption give the same greedy tokens as one-at-a-time runs."""

import pytest

from fp4moe.engine.front.llm import LLM
from fp4moe.engine.loop.core import EngineCore
from fp4moe.engine.loop.scheduler import QueueFullError, SchedulerConfig
from fp4moe.engine.request.sampler import SamplingParams

PROMPTS = ["a", "The Python tutorial " * 12, "x y z", "def f(x):\n    return x * 2\n" * 3, "Hello"]


@pytest.fixture(scope="module")
def llm(checkpoints):
    return LLM(checkpoints.bf16(), dtype="float32")


def _reference(llm, max_tokens):
    p = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return [llm.generate(x, p)[0].outputs[0].token_ids for x in PROMPTS]


def _serve(llm, config, max_tokens, arrivals=None):
    core = llm.new_core(config)
    p = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    seqs = [llm.make_sequences(x, p)[0] for x in PROMPTS]
    arrivals = arrivals or [0] * len(seqs)
    step, max_batch = 0, 0
    while any(not s.finished for s in seqs):
        for s, at in zip(seqs, arrivals, strict=True):
            if at == step:
                core.add([s])
        max_batch = max(max_batch, len(core.scheduler.running))
        core.step()
        step += 1
        assert step < 500
    assert core.scheduler.running == [] and core.kv._kv == {} and core.states._states == {}  # nothing leaked
    return [s.output_ids for s in seqs], core, max_batch


def test_continuous_batching_with_chunked_prefill_matches_sequential(llm):
    expected = _reference(llm, 12)
    got, core, max_batch = _serve(
        llm, SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=16), 12, arrivals=[0, 0, 2, 5, 9]
    )
    assert got == expected
    assert max_batch == 3  # requests really overlapped, and never more than max_num_seqs


def test_whole_prompts_wait_for_a_step_rather_than_split():
    """``whole_prompts``: a fresh prompt that the next step could take whole (beside the running decodes)
    waits instead of being split; one that no step could take whole still is; FIFO holds."""
    from fp4moe.engine.loop.scheduler import Scheduler
    from fp4moe.engine.request.sequence import Sequence

    def admit(lens, whole, decoding=0, budget=32):
        sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, whole_prompts=whole))
        for i in range(decoding):  # running sequences one token from the end of their prompt
            seq = Sequence(100 + i, [1, 2], SamplingParams(), slot=-1)
            seq.slot, seq.num_cached = sched.free_slots.pop(), 1
            sched.running.append(seq)
        for i, n in enumerate(lens):
            sched.add(Sequence(i, [7] * n, SamplingParams(), slot=-1))
        return [(s.seq_id, n) for s, n in sched.schedule(lambda slot: None) if s.seq_id < 100]

    assert admit([20, 20, 3], whole=False) == [(0, 20), (1, 12)]  # vLLM's way: the second one split
    assert admit([20, 20, 3], whole=True) == [(0, 20)]  # it waits; the 3 behind it does not jump ahead
    assert admit([20, 28], whole=True, decoding=4) == [(0, 20)]  # 28 + 4 decodes fit a step: it waits
    assert admit([20, 29], whole=True, decoding=4) == [(0, 20), (1, 8)]  # no step beside 4 decodes takes 29
    assert admit([40], whole=True) == [(0, 32)]  # longer than any step: split as before


def test_without_chunked_prefill_long_prompts_wait_their_turn(llm):
    expected = _reference(llm, 6)
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=128, enable_chunked_prefill=False)
    got, _, _ = _serve(llm, config, 6)
    assert got == expected


def test_preemption_by_recompute_when_the_cache_is_full(llm):
    expected = _reference(llm, 10)
    config = SchedulerConfig(max_num_seqs=5, max_num_batched_tokens=64, max_cached_tokens=120)
    got, core, _ = _serve(llm, config, 10)
    assert got == expected
    assert core.scheduler.num_preemptions > 0


def test_bounded_waiting_queue(llm):
    core = llm.new_core(SchedulerConfig(max_waiting=2))
    p = SamplingParams(max_tokens=2)
    core.add(llm.make_sequences("a", p))
    core.add(llm.make_sequences("b", p))
    with pytest.raises(QueueFullError, match="waiting queue is full"):
        core.add(llm.make_sequences("c", p))


def test_abort_frees_everything(llm):
    core = llm.new_core(SchedulerConfig(max_num_seqs=2))
    p = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    a, b = llm.make_sequences("first", p)[0], llm.make_sequences("second", p)[0]
    queued = llm.make_sequences("third", p)[0]  # two slots: it waits
    core.add([a, b, queued])
    for _ in range(3):
        core.step()
    assert queued in core.scheduler.waiting
    core.abort(queued)  # aborted before it ever ran: out of the queue
    assert queued not in core.scheduler.waiting
    core.abort(a)
    assert a.slot == -1
    slots = {k[1] for k in core.kv._kv} | {k[1] for k in core.states._states}
    assert slots == {b.slot}
    core.abort(b)
    assert core.kv._kv == {} and core.states._states == {} and not core.scheduler.has_work()


def test_prefix_cache_reuses_kv_and_deltanet_states(llm):
    from fp4moe.engine.loop.prefix_cache import PrefixCache

    pc = PrefixCache(block_size=16, max_entries=8)
    core = llm.new_core(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64), prefix_cache=pc)
    p = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    base = "The Python tutorial explains data structures. " * 4
    longer = base + "Then it moves on to modules and packages."

    def run(prompt):
        seq = llm.make_sequences(prompt, p)[0]
        core.add([seq])
        steps = 0
        while not seq.finished:
            core.step()
            steps += 1
        return seq

    first = run(base)
    assert pc.hits == 0 and len(pc._entries) == 1
    again = run(base)
    boundary = pc.boundary(len(first.prompt_ids))
    assert pc.hits == boundary > 0  # the whole block-aligned prefix came from the cache
    extended = run(longer)
    assert pc.hits > boundary  # the extended prompt reused the first prompt's snapshot
    fresh = llm.generate([base, longer], p)
    assert again.output_ids == first.output_ids == fresh[0].outputs[0].token_ids
    assert extended.output_ids == fresh[1].outputs[0].token_ids
    assert core.kv._kv == {} and core.states._states == {}


def test_prefix_cache_holds_at_most_its_bytes(llm):
    """Snapshots are bounded in host bytes as well as in number (a long-context prompt's snapshot is
    gigabytes): the oldest go first, and a prompt whose snapshot alone would pass the bound takes none (its
    prefill is not split at a snapshot boundary either) and still decodes the same tokens."""
    from fp4moe.engine.loop.prefix_cache import PrefixCache

    p = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prompts = [
        "The Python tutorial explains data structures. " * 4,
        "Modules, packages and the import system. " * 4,
    ]

    def run(core, prompt):
        seq = llm.make_sequences(prompt, p)[0]
        core.add([seq])
        split = seq.stop_at
        while not seq.finished:
            core.step()
        return seq, split

    probe = PrefixCache(block_size=16)
    run(
        llm.new_core(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64), prefix_cache=probe),
        prompts[0],
    )
    one = probe.bytes
    assert one > 0 and len(probe._entries) == 1
    pc = PrefixCache(block_size=16, max_entries=8, max_bytes=one * 3 // 2)
    core = llm.new_core(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64), prefix_cache=pc)
    run(core, prompts[0])
    assert pc.bytes == one and len(pc._entries) == 1
    second, _ = run(core, prompts[1])  # the first snapshot makes room for the second
    ids = second.prompt_ids
    assert 0 < pc.bytes <= pc.max_bytes and len(pc._entries) == 1 and pc.contains(ids, pc.boundary(len(ids)))
    long = prompts[0] * 3
    seq, split = run(core, long)
    assert split == 0 and len(pc._entries) == 1 and pc.bytes <= pc.max_bytes
    assert seq.output_ids == llm.generate([long], p)[0].outputs[0].token_ids


def test_fp8_kv_cache_stays_close_to_exact(checkpoints):
    import torch

    exact = LLM(checkpoints.bf16(), dtype="float32")
    fp8 = LLM(checkpoints.bf16(), dtype="float32", kv_cache_dtype="fp8")
    prompt = [int(t) for t in torch.randint(0, 1000, (90,), generator=torch.Generator().manual_seed(4))]
    logits = []
    for llm_ in (exact, fp8):
        kv, states = llm_.runner.new_caches()
        seq = llm_._make_sequences([prompt], [SamplingParams(max_tokens=1)])[1][0]
        seq.slot = 0
        ((_, row),) = llm_.runner.run([(seq, len(prompt))], kv, states)
        logits.append(row)
        if llm_ is fp8:
            assert kv._kv[(3, 0)][0].dtype == torch.float8_e4m3fn  # stored in fp8
    diff = (logits[0] - logits[1]).abs().max()
    assert 0 < diff < 0.05  # e4m3 keeps ~2 significant digits; logits are O(3)
    with pytest.raises(ValueError, match="kv cache dtype"):
        LLM(checkpoints.bf16(), kv_cache_dtype="int4")


def test_cache_budget_from_device_memory():
    from fp4moe.engine.device.memory import (
        cache_budget_tokens,
        deltanet_bytes_per_sequence,
        kv_bytes_per_token,
    )
    from fp4moe.models.qwen3_5_moe import REAL_TEXT_CONFIG, ModelArgs

    real = ModelArgs.from_text_config(REAL_TEXT_CONFIG)
    import torch

    assert (
        kv_bytes_per_token(real, "auto", torch.bfloat16) == 10 * 2 * 2 * 256 * 2
    )  # 20 KiB per token in bf16
    assert kv_bytes_per_token(real, "fp8", torch.bfloat16) == 10 * 2 * 2 * 256
    per_seq = deltanet_bytes_per_sequence(real, torch.bfloat16)
    assert per_seq == 30 * (8192 * 3 * 2 + 32 * 128 * 128 * 4)  # ~63 MB, dominated by the fp32 states
    gib = 1 << 30
    tokens = cache_budget_tokens(141 * gib, 22 * gib, 0.9, 10240, per_seq, 16)
    # by hand: 0.9 * 141 GiB = 136,257,837,465.6 B; less 22 GiB of weights (23,622,320,128 B) and 16 DeltaNet
    # states (16 * 64,389,120 = 1,030,225,920 B) leaves 111,605,291,417 B = 10,898,954 tokens of 10,240 B
    # (+ 2,457 B spare): ~10.9 M tokens of fp8 KV
    assert tokens == 10_898_954
    # the budget fits in 90% of the device and one more token would not (exact integers: 10 * used <= 9 * total)
    used = 22 * gib + 16 * per_seq
    assert 10 * (used + tokens * 10240) <= 9 * 141 * gib < 10 * (used + (tokens + 1) * 10240)
    with pytest.raises(ValueError, match="no room for the KV cache"):
        cache_budget_tokens(24 * gib, 22 * gib, 0.9, 10240, per_seq, 16)
    with pytest.raises(ValueError, match="must be in"):
        cache_budget_tokens(gib, 0, 1.5, 1, 0, 1)


def test_kv_pages_from_device_memory():
    """The GPU runner's KV pages: 90% of 141 GiB less the 40 GiB in use and a 4 GiB activation reserve,
    in pages of 64 tokens of 10,240 B, capped at what 64 sequences of 16K tokens fill (and one more)."""
    from fp4moe.engine.device.memory import kv_pages

    gib = 1 << 30
    # 0.9 * 141 GiB = 136,257,837,465.6 B, less 44 GiB (47,244,640,256 B): 89,013,197,209 B = 8,692,695 tokens
    assert kv_pages(101 * gib, 141 * gib, 10240, 0.9, 64, 2**20, 64) == 8_692_695 // 64
    assert kv_pages(101 * gib, 141 * gib, 10240, 0.9, 64, 16384, 64) == 64 * 256 + 1
    # 10 GiB, 5,373,709,120 B free: 9,663,676,416 B usable, 9,658,676,416 in use with the reserve -- 5 MB, 488
    # tokens, fewer than 16 pages
    with pytest.raises(ValueError, match="not enough GPU memory for a KV cache"):
        kv_pages(5_373_709_120, 10 * gib, 10240, 0.9, 64, 16384, 64)


def test_requests_that_can_never_run_are_refused_or_ended(llm):
    p = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    core = llm.new_core(SchedulerConfig(max_cached_tokens=20))
    with pytest.raises(ValueError, match="does not fit the cache budget"):
        core.add(llm.make_sequences("word " * 30, p))
    core = llm.new_core(SchedulerConfig(max_num_batched_tokens=8, enable_chunked_prefill=False))
    with pytest.raises(ValueError, match="chunked prefill is off"):
        core.add(llm.make_sequences("word " * 30, p))
    # a lone sequence that outgrows the cache ends with "length" instead of being preempted forever
    core = llm.new_core(SchedulerConfig(max_cached_tokens=12))
    seq = llm.make_sequences("hi there", p)[0]
    core.add([seq])
    for _ in range(40):
        if seq.finished:
            break
        core.step()
    assert seq.finished and seq.finish_reason.value == "length" and len(seq.all_ids) <= 13
    assert not core.scheduler.has_work() and core.kv._kv == {}


def test_cache_budget_is_never_exceeded(llm):
    """The keys/values the cache really holds stay within max_cached_tokens at every append, match the
    scheduler's count after every step, and the budget binds (a request waits for room)."""
    expected = _reference(llm, 10)
    budget = 100
    config = SchedulerConfig(max_num_seqs=5, max_num_batched_tokens=24, max_cached_tokens=budget)
    core = llm.new_core(config)
    p = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    seqs = [llm.make_sequences(x, p)[0] for x in PROMPTS]
    kv, sched = core.kv, core.scheduler
    attention_layers = {i for i, t in enumerate(llm.model.args.layer_types) if t == "full_attention"}

    def held(layer: int) -> int:
        """Tokens of keys (and as many values) stored at one attention layer, over all slots."""
        lens = [(len(k), len(v)) for (lay, _), (k, v) in kv._kv.items() if lay == layer]
        assert all(nk == nv for nk, nv in lens)
        return sum(nk for nk, _ in lens)

    peak, blocked = 0, False
    append = kv.append

    def append_and_measure(layer, slot, k, v):
        nonlocal peak
        out = append(layer, slot, k, v)
        peak = max(peak, held(layer))  # mid-step, before finished sequences are freed
        return out

    kv.append = append_and_measure
    core.add(seqs)
    while any(not s.finished for s in seqs):
        core.step()
        assert {held(layer) for layer in attention_layers} == {sched.cached_tokens()}
        # the head of the queue waits because the cache budget, not a slot or the step's tokens, is short
        blocked |= bool(sched.waiting) and sched.reserved_tokens() + len(sched.waiting[0].all_ids) > budget
    assert [s.output_ids for s in seqs] == expected
    assert peak <= budget
    assert blocked and peak >= budget - 5  # the limit mattered (measured peak: 99 of 100)


def test_generate_is_the_servers_engine_loop(checkpoints, monkeypatch):
    """Offline ``LLM.generate`` steps the same ``EngineCore`` the server does (one loop): with 2 sequence
    slots and 16 tokens a step, five prompts queue, prefill in chunks and give exactly the server loop's
    tokens (same steps, same arithmetic); ``on_token`` sees every token once."""
    llm = LLM(checkpoints.bf16(), dtype="float32", max_num_seqs=2, max_num_batched_tokens=16)
    served, _, max_batch = _serve(llm, SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16), 7)
    running, seen = [], []
    real_step = EngineCore.step

    def step(core):
        out = real_step(core)
        running.append(len(core.scheduler.running) + sum(o.finished for o in out))
        return out

    monkeypatch.setattr(EngineCore, "step", step)
    p = SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)
    outs = llm.generate(PROMPTS, p, on_token=lambda i, token, delta: seen.append((i, token)))
    assert [o.outputs[0].token_ids for o in outs] == served
    assert max(running) == max_batch == 2 and len(running) > 7  # queued, chunked: more steps than tokens
    assert sorted(seen) == sorted((i, t) for i, o in enumerate(outs) for t in o.outputs[0].token_ids)


def test_sequence_token_access_copies_nothing_and_agrees_with_all_ids():
    from fp4moe.engine.request.sequence import Sequence

    seq = Sequence(0, [5, 6, 7], SamplingParams(), slot=0, output_ids=[8, 9])
    assert seq.num_tokens == len(seq.all_ids) == 5
    assert [seq.token(i) for i in range(-5, 5)] == seq.all_ids * 2
    for start in range(6):
        for end in range(start, 6):
            assert seq.tokens(start, end) == seq.all_ids[start:end], (start, end)


def test_generate_reports_each_token_once_when_the_cache_ends_a_sequence(checkpoints):
    """A sequence ended because the cache cannot hold it (finish reason length, no new token) is not
    reported to ``on_token`` a second time."""
    llm = LLM(checkpoints.bf16(), dtype="float32", max_cached_tokens=12)
    seen = []
    p = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    out = llm.generate([[5, 6, 7, 8, 9, 10, 11, 12]], p, on_token=lambda i, t, d: seen.append(t))[0].outputs[
        0
    ]
    assert out.finish_reason == "length" and len(out.token_ids) < 20  # ended by the cache, not max_tokens
    assert seen == out.token_ids


def test_step_trace_records_each_step_and_the_summary_counts_them(llm, tmp_path, monkeypatch):
    """``FP4MOE_STEP_TRACE``: one line per engine step with the rows it scheduled; ``benchmarks/step_trace.py``
    sums them by kind. Five prompts through two slots in 16-token steps: their prefill tokens add up to the
    prompts (and nothing else), every decode row is one of their generated tokens but the first."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
    import step_trace

    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv("FP4MOE_STEP_TRACE", str(path))
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16)
    got, core, _ = _serve(llm, config, 5)  # five prompts, two slots
    core.trace._file.flush()
    steps = step_trace.read(path)
    assert len(steps) == core.stats.steps
    prompt_tokens = sum(len(llm.tokenizer.encode(x)) for x in PROMPTS)
    s = step_trace.summary(steps)
    assert s["prefill_tokens"] == prompt_tokens == core.stats.prompt_tokens
    assert sum(x["decode"] for x in steps) == sum(len(ids) - 1 for ids in got)
    assert s["prefill_steps"] + s["mixed_steps"] + s["decode_steps"] + s["empty_steps"] == s["steps"]
    assert s["mixed_steps"] > 0 and s["decode_steps"] > 0  # five prompts through two slots overlap
    assert all(x["dt"] >= 0 and x["running"] <= 2 for x in steps)
    assert s["busy_s"] <= s["wall_s"] + 1e-6


@pytest.mark.parametrize(
    "seed,chunked,whole,cache",
    [
        (0, True, False, 1 << 20),
        (1, True, True, 1 << 20),
        (2, True, False, 300),
        (3, False, False, 300),
        (4, True, True, 260),
    ],
)
def test_without_a_prefix_cache_a_step_continues_one_prompt_at_most(seed, chunked, whole, cache):
    """The serve warm-up captures the prefill graphs of chunks over cached prefixes for one sequence only when
    no prefix cache serves (``LLM.warmup``): it relies on the scheduler splitting one prompt at a time. Random
    arrivals, prompts up to several steps long, decodes, preemption by a small cache, chunked prefill off
    (recomputes -- prompt and output longer than a step -- still chunk), ``whole_prompts``: no step holds two
    chunks that continue a prompt (cached tokens before it, more than the one token of a decode)."""
    import random

    from fp4moe.engine.loop.scheduler import Scheduler
    from fp4moe.engine.request.sequence import Sequence

    rng = random.Random(seed)
    budget = 64
    config = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=budget, enable_chunked_prefill=chunked,
                             max_cached_tokens=cache, whole_prompts=whole)  # fmt: skip
    sched = Scheduler(config)
    wanted, ids, continuing_steps, steps = {}, iter(range(10**6)), 0, 0
    for _ in range(600):
        for _ in range(rng.choice([0, 0, 0, 1, 2])):
            n = (
                rng.choice([1, 2, 5, 30, 63, 64, 65, 100, 150, 200])
                if chunked
                else rng.randrange(1, budget + 1)
            )
            seq = Sequence(next(ids), [7] * n, SamplingParams(), slot=-1)
            if sched.can_add():
                sched.add(seq)
                wanted[seq.seq_id] = rng.randrange(1, 40 if chunked else 120)
        batch = sched.schedule(lambda slot: None)
        steps += bool(batch)
        continuing = [
            s for s, n in batch if s.num_cached > 0 and not (n == 1 and s.num_cached == s.num_tokens - 1)
        ]
        assert len(continuing) <= 1, [(s.seq_id, s.num_cached, s.num_tokens, n) for s, n in batch]
        continuing_steps += bool(continuing)
        for seq, n in batch:
            seq.num_cached += n
            if seq.num_cached == seq.num_tokens:  # its prompt (or last token) is in: one more token
                seq.output_ids.append(5)
                if len(seq.output_ids) >= wanted[seq.seq_id]:
                    sched.finish(seq, lambda slot: None)
        for seq in sched.cache_full:
            assert seq not in sched.running
        sched.cache_full.clear()
    # the workload did split prompts (without chunked prefill only recomputes are split)
    assert steps > 300 and continuing_steps > (10 if chunked else 5)
