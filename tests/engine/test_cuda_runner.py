"""The GPU runner's fused decode step (paged caches, fused kernels) against the module path.

Without CUDA the kernels run under Triton's interpreter on the CPU (graphs off); with CUDA the same test
runs on the GPU with graphs on. Both paths compute in bf16 but in different orders (the interpreter's dots are
numpy's, so OpenBLAS's kernel for the CPU at hand; the GPU's are cuBLAS's and ours), so greedy tokens must
agree up to a near tie of the reference (fp4moe.engine.compare), on every CPU and on the GPU alike: a split
ends that sequence's comparison, and each check says how many tokens it compared."""

from __future__ import annotations

import collections

import pytest
import torch

pytest.importorskip("triton")

from fp4moe.engine.compare import greedy_agreement  # noqa: E402
from fp4moe.engine.cuda_runner import CudaModelRunner  # noqa: E402
from fp4moe.engine.llm import LLM  # noqa: E402
from fp4moe.engine.sampler import SamplingParams  # noqa: E402
from fp4moe.engine.spec_decode import MTPSpeculator  # noqa: E402
from fp4moe.layers.moe import SparseMoE  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
PROMPTS = [[5, 17, 300, 2, 9], list(range(40, 110)), [7]]


def _agree(ref, got, **kwargs):
    """Greedy agreement up to near ties (lengths equal unless a sequence parted at a near tie); prints what
    it compared (``pytest -s`` or a failure shows it). A comparison that ended at the first token everywhere
    would check nothing: at least one token per sequence and a third of all must have been compared (the
    tiny random model's logits are flat, so near ties are common: 1 in ~20 tokens here)."""
    agree = greedy_agreement(ref, got, **kwargs)
    print(f"agreement: {agree}")
    assert agree.ok, str(agree)
    assert agree.compared >= max(len(ref), agree.total / 3), str(agree)
    return agree


def _all_pages_back(runner) -> bool:
    """Every page is back in the pool but the scratch slot's one."""
    return runner.kv.num_free_pages == runner.kv.k.shape[1] - 1


def _fused(llm: LLM, kv_cache_dtype: str = "auto", spec_tokens: int = 0, **sizes) -> None:
    sizes = {"max_num_seqs": 4, "max_model_len": 256, **sizes}
    llm.runner = CudaModelRunner(
        llm.model, None, llm.device, kv_cache_dtype, num_pages=20, page_size=16, cuda_graphs=DEV == "cuda",
        spec_tokens=spec_tokens, **sizes,
    )  # fmt: skip
    # prompts through the modules, so the CPU's exact comparisons see the fused decode step alone (the fused
    # prefill sums the experts in fp32, the modules in bf16: test_fused_decode_... checks it on its own)
    llm.runner.fused_prefill = False
    if spec_tokens:
        llm.speculator = MTPSpeculator(llm, spec_tokens)


MIXED = "attention,shared,deltanet:fp8,lm_head"  # NVFP4 and FP8 linears in the fused projections


@pytest.mark.parametrize(
    "which,fused_prefill", [("bf16", False), ("nvfp4", False), ("mixed", False), ("nvfp4", True)]
)
def test_fused_decode_gives_the_module_paths_greedy_tokens(checkpoints, which, fused_prefill, monkeypatch):
    """The fused decode step (prompts prefilled by the modules: on the CPU the tokens are identical), and
    the fused prefill (its expert sum is fp32 where the CPU modules add bf16 per expert, as transformers
    does: the tokens agree up to near ties)."""
    if which == "bf16":
        path = checkpoints.bf16()
    else:
        # RTN scales for the exactness check: with this tiny random model's MSE checkpoint one decode step
        # lands on a near-tied router choice, and the two paths' last-bit differences pick different
        # experts (a logit jump no near-tie rule on the tokens can excuse); the kernels are checked against
        # MSE-scaled weights in tests/kernels
        options = {"quantize_extra": MIXED} if which == "mixed" else {"scale_method": "rtn"}
        path = checkpoints.quantized(**options)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    ref = LLM(path, dtype="bfloat16", device="cpu")
    expected = ref.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    llm = LLM(path, dtype="bfloat16", device=DEV)
    if DEV == "cpu":
        _fused(llm)
    llm.runner.fused_prefill = fused_prefill
    calls, module_moe = [], []
    forward = llm.runner.decode_forward
    llm.runner.decode_forward = lambda b: calls.append(b) or forward(b)
    moe_forward = SparseMoE.forward
    monkeypatch.setattr(SparseMoE, "forward", lambda self, x: module_moe.append(1) or moe_forward(self, x))
    got = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert bool(module_moe) != fused_prefill  # the prompts went through the path asked for
    _agree(expected, got)
    assert calls  # the decode steps took the fused path (on CUDA: the warm-up before each capture) ...
    assert bool(llm.runner.graphs) == (DEV == "cuda")  # ... and on CUDA the captured graphs replayed it
    assert _all_pages_back(llm.runner)


def test_fused_decode_logits_close_with_an_fp8_cache(checkpoints):
    """Decode steps exactly as the modules (prompts through the modules); then the fused prefill too, which
    sets each layer's fp8 scales from its own keys/values: tokens agree up to near ties."""
    path = checkpoints.quantized()
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=2)
    ref = LLM(path, dtype="bfloat16", device="cpu", kv_cache_dtype="fp8")
    expected = ref.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    if DEV == "cuda":
        pytest.skip("the fp8 path on the GPU is checked by benchmarks/decode.py's gate")
    llm = LLM(path, dtype="bfloat16", device="cpu", kv_cache_dtype="fp8")
    _fused(llm, "fp8")
    _agree(expected, llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params))
    llm = LLM(path, dtype="bfloat16", device="cpu", kv_cache_dtype="fp8")
    _fused(llm, "fp8")
    llm.runner.fused_prefill = True
    _agree(expected, llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params))


def test_serving_engine_with_prefix_caching_on_the_paged_caches(checkpoints):
    """Continuous batching + prefix caching through the GPU runner's paged caches (snapshots of pages and
    state slots) gives the module path's tokens; every page is returned at the end."""
    from fp4moe.engine.core import EngineCore
    from fp4moe.engine.prefix_cache import PrefixCache
    from fp4moe.engine.scheduler import SchedulerConfig

    path = checkpoints.quantized()
    p = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=2)
    base = list(range(100, 140))
    prompts = [base, base + [7, 8, 9], [3, 4]]
    ref = LLM(path, dtype="bfloat16", device="cpu").generate([{"prompt_token_ids": x} for x in prompts], p)
    llm = LLM(path, dtype="bfloat16", device=DEV)
    if DEV == "cpu":
        _fused(llm)
    pc = PrefixCache(block_size=16, max_entries=8)
    core = EngineCore(llm, SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=32), prefix_cache=pc)
    seqs = [core.make_sequences({"prompt_token_ids": x}, p)[0] for x in prompts]
    core.add(seqs[:1])
    while not seqs[0].finished:
        core.step()
    core.add(seqs[1:])
    for _ in range(200):
        if all(s.finished for s in seqs):
            break
        core.step()
    assert pc.hits >= 32  # the second prompt restored the first one's snapshot
    from types import SimpleNamespace

    served = [
        SimpleNamespace(outputs=[SimpleNamespace(token_ids=s.output_ids, logprobs=s.logprobs)]) for s in seqs
    ]
    _agree(ref, served)  # bf16 GEMM order may split greedy paths at near ties
    assert _all_pages_back(llm.runner)


def test_mixed_steps_keep_decodes_on_the_fused_step(checkpoints, monkeypatch):
    """A step that mixes prefill chunks with decoding rows runs the chunks through the module path and the
    decodes through the fused step (they went through the module path before: issue 20's profile); plain
    greedy rows are sampled by one batched argmax. The tokens are the CPU module path's."""
    from fp4moe.engine.core import EngineCore
    from fp4moe.engine.model_runner import ModelRunner
    from fp4moe.engine.scheduler import SchedulerConfig

    path = checkpoints.quantized()
    p = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[3, 4, 5], list(range(40, 110)), [9, 8]]
    with_logprobs = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)  # near ties
    ref = LLM(path, dtype="bfloat16", device="cpu").generate(
        [{"prompt_token_ids": x} for x in prompts], with_logprobs
    )
    llm = LLM(path, dtype="bfloat16", device=DEV)
    if DEV == "cpu":
        _fused(llm)
    runner, mixed, module_rows = llm.runner, [], []
    real_module_run, real_decode = ModelRunner.run, runner.decode_step

    def module_run(self, batch, kv, states, keep=None):
        module_rows.extend(n for _, n in batch)
        return real_module_run(self, batch, kv, states, keep)

    def decode_step(seqs, **kw):
        mixed.append(len(module_rows) > 0)
        return real_decode(seqs, **kw)

    monkeypatch.setattr(ModelRunner, "run", module_run)
    monkeypatch.setattr(runner, "decode_step", decode_step)
    core = EngineCore(llm, SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=16))
    seqs = [core.make_sequences({"prompt_token_ids": x}, p)[0] for x in prompts]
    core.add([seqs[0]])
    core.step()  # the first prompt's prefill: it decodes from the next step on
    core.add(seqs[1:])
    steps_with_both, every_module_row = 0, []
    for _ in range(100):
        if all(s.finished for s in seqs):
            break
        module_rows.clear()
        before = len(mixed)
        core.step()
        steps_with_both += len(mixed) > before and bool(module_rows)
        every_module_row += module_rows
    assert steps_with_both >= 3  # the 70-token prompt took 16-token chunks beside the decodes
    assert 1 not in every_module_row  # no decoding row went through the modules (chunks: 16s, 6, 2)
    _agree(ref, [s.output_ids for s in seqs])
    assert _all_pages_back(llm.runner)


def test_more_prompts_than_state_slots_run_in_waves(checkpoints):
    path = checkpoints.bf16()
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": [5 + i, 9, 11 + i]} for i in range(6)]
    ref = LLM(path, dtype="bfloat16", device="cpu").generate(prompts, params)
    llm = LLM(path, dtype="bfloat16", device=DEV, max_num_seqs=4)
    if DEV == "cpu":
        _fused(llm)  # 4 slots
    assert llm.runner.max_num_seqs == 4
    _agree(ref, llm.generate(prompts, params))
    assert _all_pages_back(llm.runner)


def test_an_abandoned_stream_leaves_no_cache_behind(checkpoints):
    path = checkpoints.bf16()
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm = LLM(path, dtype="bfloat16", device=DEV)
    if DEV == "cpu":
        _fused(llm)
    ref = llm.generate([{"prompt_token_ids": [9, 8, 7]}], params)[0].outputs[0].token_ids
    stream = llm.stream({"prompt_token_ids": list(range(50, 100))}, SamplingParams(max_tokens=20))
    next(iter(stream))
    stream.close()  # abandoned after one token
    assert _all_pages_back(llm.runner)
    # the same engine, the same batch of one: the same kernels in the same order, so exactly the same tokens
    assert llm.generate([{"prompt_token_ids": [9, 8, 7]}], params)[0].outputs[0].token_ids == ref


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


def test_a_rejected_draft_head_stops_drafting_after_its_probe(checkpoints):
    """The tiny model's random MTP head: its drafts are almost never accepted, so after PROBE_ROUNDS fused
    rounds the sequence decodes plainly (not slower than without speculation, issue 20); the tokens stay
    plain greedy decoding's."""
    from fp4moe.engine import spec_decode

    path = checkpoints.bf16()
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": PROMPTS[0]}, {"prompt_token_ids": PROMPTS[2]}]
    ref = LLM(path, dtype="bfloat16", device="cpu").generate(
        prompts, SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, logprobs=2)
    )
    llm = LLM(path, dtype="bfloat16", device=DEV, num_speculative_tokens=2)
    if DEV == "cpu":
        _fused(llm, spec_tokens=2)
    spec, rounds = llm.speculator, []
    real_launch = spec.launch_round

    def launch_round(seqs, chained=False):  # every fused round, synchronous or run ahead
        rounds.append(len(seqs))
        return real_launch(seqs, chained)

    spec.launch_round = launch_round
    _agree(ref, llm.generate(prompts, params))
    assert spec.stats.accepted < 2 * spec_decode.MIN_ACCEPTED * spec_decode.PROBE_ROUNDS
    assert spec.stats.backed_off == 2 and rounds == [2] * spec_decode.PROBE_ROUNDS


def test_first_drafts_on_the_fused_mtp_rows_are_the_module_paths(checkpoints):
    """A greedy request's first drafts (after its prompt) come from the fused MTP rows: the head catches up
    on the whole prompt, only each sequence's last row on through the MoE. They are the module path's
    drafts up to a near tie of its draft logits (both bf16, summed in other orders: the tie of
    fp4moe.engine.compare), and the head's cache and inputs end where the module path leaves them."""
    from fp4moe.engine.core import EngineCore
    from fp4moe.engine.scheduler import SchedulerConfig

    llm = LLM(checkpoints.bf16(), dtype="bfloat16", device=DEV, num_speculative_tokens=2)
    if DEV == "cpu":
        _fused(llm, spec_tokens=2)
    spec, kv, states = llm.speculator, llm.runner.kv, llm.runner.states
    core = EngineCore(llm, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256))
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    seqs = [core.make_sequences({"prompt_token_ids": p}, greedy)[0] for p in PROMPTS]
    core.add(seqs)
    core.step()  # the prompts, and each one's first token
    assert all(len(s.output_ids) == 1 and s.drafts is None for s in seqs)
    inputs = [(s.mtp_cached, s.hidden_tail.clone()) for s in seqs]
    module = spec._mtp_drafts_many(seqs, kv, states)
    for s, (cached, tail) in zip(seqs, inputs, strict=True):
        s.mtp_cached, s.hidden_tail = cached, tail
    fused = spec._first_drafts(seqs, kv)
    compared = 0
    for (drafts, logits), got in zip(module, fused, strict=True):
        for want, row, token in zip(drafts, logits, got, strict=True):
            if token != want:  # a later draft follows another token: the comparison ends here
                logprobs = torch.log_softmax(row.float(), -1)
                assert logprobs[want] - logprobs[token] < 0.1, (drafts, got)
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


@pytest.mark.parametrize("drafts", ["mtp", "oracle", "second-wrong", "kv-fp8"])
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
        async_scheduling=not oracle,
    )  # fmt: skip
    if DEV == "cpu":
        _fused(llm, kv_dtype, spec_tokens=k)
    spec = llm.speculator
    assert spec.fused is not None
    if oracle:
        fused, lens = spec.fused, [len(p) for p in PROMPTS]
        launch = fused.launch

        def oracle_launch(slots, positions, tokens, deltas, sampling=None):  # sequence i sits in slot i
            for slot, p, row in zip(slots, positions, tokens, strict=True):
                cont = truth[slot][p - lens[slot] + 1 :] + [0] * k
                row[1:] = cont[:k]
                if drafts == "second-wrong":
                    row[2] = (row[2] + 1) % 100
            return launch(slots, positions, tokens, deltas, sampling)

        fused.launch = oracle_launch
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    agree = _agree(ref, [o.outputs[0].token_ids for o in llm.generate(prompts, params)])
    stats = spec.stats
    assert stats.drafts > 0
    if drafts == "oracle":  # every draft is the reference's continuation: most are accepted ...
        assert stats.accepted_per_position[1] > 0
        # ... all of them while the engine's tokens are the reference's (a near-tie split makes the later
        # oracle drafts wrong for the engine's own continuation)
        assert stats.mean_acceptance_length > 2.5 or not agree.identical, stats.mean_acceptance_length
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
    from fp4moe.engine.cuda_spec import GREEDY, SAMPLED, SORTED
    from fp4moe.engine.sampler import filter_logits
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
    runs = [[o.outputs[0].token_ids for o in llm.generate(prompts, params)] for _ in range(2)]
    assert runs[0] == runs[1]  # the same engine, the same seeds: the same arithmetic, the same tokens
    got = runs[0]
    _agree([ref[0], ref[2]], [got[0], got[2]])
    want = SORTED if variant == "sorted" else SAMPLED
    assert sum(rounds) >= 4  # >= 2 sampled rounds per run ...
    # ... in the graph variant that fits them (on the GPU the forwards ran once, to capture each variant)
    assert want in modes and set(modes) <= {GREEDY, want}
    assert DEV == "cpu" or {mode for _, mode in fused.graphs} == set(modes)
    assert sorted(set(stored)) == [1, 2]  # the module path's first drafts of the sampled sequences
    assert spec.stats.accepted_per_position[k - 1] > 0
    sampled = PROMPTS[1] + got[1]
    logprobs, _ = window_outputs(ref_llm, sampled)
    for i in range(len(PROMPTS[1]), len(sampled)):
        kept = filter_logits(logprobs[i - 1], params[1]) > float("-inf")
        assert kept[sampled[i]], f"token {i - len(PROMPTS[1])} ({sampled[i]}) is not one the filter keeps"
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
        sample_all = llm.sample_all  # every sampling goes through it

        def wrapped(results):
            for seq, logits in results:
                if seq.params.top_p < 1:
                    sampled_logits.setdefault(run, []).append(logits.float().cpu().clone())
            return sample_all(results)

        llm.sample_all = wrapped

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


class _Replay:
    """A stand-in CUDA graph: its replay reruns the captured function into the buffers the capture returned
    (outputs read from those buffers, refilled by every replay, as a real graph's are)."""

    def __init__(self, fn, out):
        self.fn, self.out = fn, out

    def replay(self):
        new = self.fn()
        pairs = zip(self.out, new, strict=True) if isinstance(self.out, tuple) else [(self.out, new)]
        for buf, value in pairs:
            buf.copy_(value)


def _emulate_graphs(runner) -> None:
    runner.cuda_graphs = True

    def graph_of(fn, pool=None):
        out = fn()
        return _Replay(fn, out), out

    runner.graph_of = graph_of


def test_graph_branches_on_the_cpu_with_an_emulated_graph(checkpoints):
    """The runner's and the fused round's graph branches (outputs read from the buffers the capture
    returned, refilled by every replay) with a stand-in graph whose replay reruns the captured function into
    those buffers: the same tokens as without graphs, for plain decoding and for speculation with plain
    steps mixed in (a top-p sequence)."""
    if DEV == "cuda":
        pytest.skip("real CUDA graphs run on the GPU")

    path = checkpoints.bf16()
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:3]]
    params = [
        SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=3, temperature=1.0, top_p=0.9, seed=5, ignore_eos=True),
        SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
    ]
    for k in (0, 2):
        outs = []
        for graphs in (False, True):
            llm = LLM(path, dtype="bfloat16", device=DEV, num_speculative_tokens=k)
            _fused(llm, spec_tokens=k)
            if graphs:
                _emulate_graphs(llm.runner)
            outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
            assert (
                bool(llm.runner.graphs) == graphs
            )  # the decode step's graph branch ran (top-p: plain steps)
            if k and graphs:
                assert llm.speculator.fused.graphs  # and the fused round's
        assert outs[0] == outs[1], k


def test_plain_steps_under_load_leave_the_mtp_cache_to_the_head(checkpoints):
    """Over --speculative-disable-by-batch-size the fused plain step runs (keeping the MTP head's inputs);
    it writes the target's keys/values only, so the MTP layer's cache length stays where the head's own
    catch-up left it (else the catch-up would write past it); once the batch shrinks, drafting resumes and
    the tokens are plain greedy decoding's."""
    from fp4moe.engine.core import EngineCore
    from fp4moe.engine.scheduler import SchedulerConfig

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
    core = EngineCore(llm, SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64))
    seqs = [
        core.make_sequences(
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


@pytest.mark.parametrize("limit", [2048, 8192])
def test_prefill_graphs_hold_up_to_their_row_limit(checkpoints, limit):
    """--prefill-graph-tokens: sixteen 500-token prompts (an 8,192-token step) take one 16 x 512 graph when a
    graph may hold 8,192 rows, none at the default 2,048 (four 4 x 512 groups then); the graphs' inputs are
    sized for the limit before any capture reads them."""
    llm = LLM(checkpoints.bf16(), dtype="bfloat16", device=DEV)
    runner = CudaModelRunner(
        llm.model, None, llm.device, max_num_seqs=16, max_model_len=1024, num_pages=20, page_size=16,
        cuda_graphs=True, prefill_graph_tokens=limit,
    )  # fmt: skip
    assert runner.prompt_ids.numel() == runner.prompt_rows.numel() == limit
    assert runner.prompt_bucket([500] * 16) == ((16, 512) if limit >= 8192 else None)
    assert runner.prompt_bucket([500] * 4) == (4, 512)


def _bucketing(max_rows: int, max_num_seqs: int = 64):
    """A stand-in runner with just what ``prompt_bucket`` and ``_prompt_groups`` read, every prompt fresh."""
    import types

    fake = types.SimpleNamespace(
        cuda_graphs=True, use_prompt_graphs=True, max_num_seqs=max_num_seqs, max_prompt_graph_tokens=max_rows
    )
    fake.prompt_bucket = lambda lens: CudaModelRunner.prompt_bucket(fake, lens)
    fake._bucket = lambda longest, count: CudaModelRunner._bucket(fake, longest, count)
    fake._prompt_graph_fits = lambda seq, n, kv: True
    return fake


def _grouper(max_rows: int, max_num_seqs: int = 64):
    fake = _bucketing(max_rows, max_num_seqs)
    return lambda lens: CudaModelRunner._prompt_groups(fake, [(None, n) for n in lens], None)


def test_prefill_graph_groups_have_the_fewest_rows_and_replays():
    """``_prompt_groups``: a served step's fifteen prompts of 466-530 tokens take one 16 x 576 graph (9,216
    rows, the default limit for an 8,192-token step) where they took two 8 x 576 ones and a 1 x 512; at
    8,192 rows, two graphs and no third; a short prompt beside a much longer one stays alone only when its
    padding would cost more than a replay. Against every split of the sorted prompts into consecutive groups
    (all 2^(n-1) of them, random lengths): never more rows + REPLAY_ROWS per replay, and each prompt in one
    group whose graph holds it. (Only splits into full groups but the last are weighed: the brute force
    checks that this loses nothing.)"""
    import itertools
    import random

    from fp4moe.engine.cuda_runner import REPLAY_ROWS

    served = [530] + [524] * 13 + [466]
    assert [b for _, b in _grouper(9216)(served)] == [(16, 576)]
    assert [b for _, b in _grouper(8192)(served)] == [(8, 576), (8, 576)]
    assert [b for _, b in _grouper(9216)([512] * 16)] == [(16, 512)]
    assert [b for _, b in _grouper(9216)([20, 1000])] == [(2, 1024)]  # 1,004 padded rows < a replay
    assert [b for _, b in _grouper(9216)([600, 2000])] == [(1, 2048), (1, 640)]
    assert _grouper(9216)([]) == []
    rng = random.Random(0)
    for _ in range(400):
        max_rows = rng.choice([512, 2048, 9216])
        lens = [
            rng.choice([rng.randint(2, 64), rng.randint(2, 600), rng.randint(2, 2048)])
            for _ in range(rng.randint(1, 10))
        ]
        lens = [n for n in lens if n <= max_rows]
        if not lens:
            continue
        seqs = rng.choice([3, 8])  # a slot count that is not a graph's sequences too
        grouper, fake = _grouper(max_rows, max_num_seqs=seqs), _bucketing(max_rows, max_num_seqs=seqs)
        groups = grouper(lens)
        assert sorted(i for g, _ in groups for i in g) == list(range(len(lens)))
        for g, (b, t) in groups:
            assert len(g) <= b and max(lens[i] for i in g) <= t and b * t <= max_rows

        def cost(parts):
            return sum(b * t + REPLAY_ROWS for b, t in parts)

        order = sorted(range(len(lens)), key=lambda i: -lens[i])
        best = float("inf")
        for cuts in itertools.product([False, True], repeat=max(0, len(order) - 1)):
            parts, start = [], 0
            for k, cut in enumerate([*cuts, True], 1):
                if cut:
                    bucket = fake.prompt_bucket([lens[i] for i in order[start:k]])
                    if bucket is None:
                        break
                    parts.append(bucket)
                    start = k
            else:
                best = min(best, cost(parts))
        assert cost([b for _, b in groups]) == best, (lens, groups)


def test_fresh_prompts_through_their_prefill_graph(checkpoints):
    """A step of four fresh prompts (66 tokens in a 1 x 96-row graph, whose padding runs past the last page
    of the CPU runner's 72-token context; 20 tokens alone in 1 x 32 rows; 12 and 9 tokens in 2 x 16 rows:
    ``prompt_forward``; on the CPU through a stand-in graph, on the GPU the real one) beside a continuing
    chunk (the module path), against the same runner's eager prefill (``hidden_states``) of the same step: the same hidden states, keys/values
    and Gated DeltaNet states up to rounding (the padded rule and the fused projections sum in another
    order), the padding's keys/values nowhere but the scratch page (every other page as it was). The
    padding is what could go wrong: its decay and write strength are masked, or the states would have run
    on for the padded rows. (Tokens through the graphs: the GPU runs of this file.)"""
    from fp4moe.engine.sequence import Sequence

    path = checkpoints.bf16()  # (the experts' format is the MoE's business, the same on both paths)
    prompts = {
        0: list(range(40, 52)),
        1: [3, 4, 5, 6, 7, 8],
        2: list(range(200, 209)),
        3: list(range(300, 320)),
        4: list(range(400, 466)),
    }
    runs = {}
    for graphs in (False, True):
        llm = LLM(path, dtype="bfloat16", device=DEV)
        if DEV == "cpu":
            # the 66-token prompt's 96 rows run past the 5 pages of 16 rows a 72-token context has
            _fused(llm, max_num_seqs=5, max_model_len=72)
            llm.runner.fused_prefill = True
            if graphs:
                _emulate_graphs(llm.runner)
        else:
            llm.runner.cuda_graphs = graphs
        runner, kv = llm.runner, llm.runner.kv
        runner.max_prompt_graph_tokens = 96
        seqs = {i: Sequence(i, p, SamplingParams(max_tokens=1), slot=i) for i, p in prompts.items()}
        runner.run([(seqs[1], 3)], kv, runner.states)  # half of a prompt: the step continues it
        pages_before = kv.k.clone()
        step = [(seqs[0], 12), (seqs[1], 3), (seqs[2], 9), (seqs[3], 20), (seqs[4], 66)]
        hidden, spans = runner.forward(step, kv, runner.states)
        # one graph per row bucket: the 20 tokens are not padded to the 66's 96 rows
        assert sorted(runner.prompt_graphs) == ([(1, 16), (1, 32), (1, 96), (2, 16)] if graphs else [])
        assert spans == [(0, 12), (12, 15), (15, 24), (24, 44), (44, 110)]
        rows = {i: kv.rows(i, 0, len(p)) for i, p in prompts.items()}
        mine = torch.zeros(kv.k.shape[1] * kv.page_size, dtype=torch.bool)
        for r in rows.values():
            mine[r.cpu()] = True
        mine.view(-1, kv.page_size)[int(kv.block_table[runner.scratch, 0])] = True
        flat, mine = (kv.k.shape[0], -1, *kv.k.shape[3:]), mine.to(kv.k.device)
        assert torch.equal(kv.k.view(flat)[:, ~mine], pages_before.view(flat)[:, ~mine])
        gi = list(runner.states.index.values())
        runs[graphs] = dict(
            hidden=hidden.float().cpu(), k=torch.cat([kv.k.view(flat)[:, r] for r in rows.values()], 1).float().cpu(),
            rec=runner.states.rec[gi][:, :5].cpu(), ring=runner.states.ring[gi][:, :5].float().cpu(),
        )  # fmt: skip
    eager, graph = runs[False], runs[True]
    # bf16 activations (O(3) here): a few ulps where a rounding flips and is carried through the layers (the
    # CPU measured equal bits but in the fp32 states); the fp32 states (O(0.05)): a flipped bf16 input's
    # share. Unmasked padding moved them by 0.06.
    for key in ("hidden", "k", "ring"):
        torch.testing.assert_close(graph[key], eager[key], atol=6e-2, rtol=2e-2)
    torch.testing.assert_close(graph["rec"], eager["rec"], atol=2e-3, rtol=1e-2)


@pytest.mark.gpu
def test_no_kernel_is_compiled_after_the_warm_up(checkpoints):
    """After ``LLM.warmup`` a served mix -- fresh prompts of many lengths, chunked long ones, prompts that
    share steps with decodes, greedy and sampled, every batch size -- compiles no Triton kernel (each compile
    is a request waiting 0.3-2 s; the H200 server at 16 streams spent 30-64% of its engine thread there)."""
    import random

    from fp4moe.kernels import compiles

    path = checkpoints.quantized()
    llm = LLM(
        path, dtype="bfloat16", device="cuda", max_num_seqs=8, max_num_batched_tokens=256, max_model_len=1024
    )
    llm.warmup(256)
    rng = random.Random(20)
    for round_ in range(6):
        prompts = [[rng.randrange(5, 500) for _ in range(rng.choice([1, 2, 7, 16, 33, 100, 255, 256, 300, 700]))]
                   for _ in range(rng.randrange(1, 12))]  # fmt: skip
        params = [
            SamplingParams(max_tokens=rng.randrange(1, 9), ignore_eos=True, temperature=rng.choice([0.0, 0.8]),
                           top_p=rng.choice([1.0, 0.9]), seed=round_)
            for _ in prompts
        ]  # fmt: skip
        llm.generate(prompts, params)
    assert compiles.after_mark() == {}


def test_async_scheduling_overlaps_decode_steps_and_keeps_the_tokens(checkpoints):
    """Async scheduling (``EngineCore.step``): decode-only steps launch before the previous step's tokens
    are read back, their inputs the device's sampled ids. Greedy tokens are the synchronous schedule's on
    the same runner (up to near ties: a wasted row changes a step's batch); a sequence that a stop token ends while its next row is already in flight gets no extra
    token; lengths hold for sampled (seeded) and penalized sequences (which keep steps synchronous while
    they run); an arrival and an abort mid-chain fall back to the synchronous schedule; every page comes
    back."""
    from types import SimpleNamespace

    from fp4moe.engine.core import EngineCore
    from fp4moe.engine.scheduler import SchedulerConfig
    from fp4moe.engine.sequence import FinishReason

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
    core = EngineCore(llm, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), async_scheduling=True)
    params = [SamplingParams(**{**vars(p), "logprobs": None}) for p in ref_params] + [
        SamplingParams(max_tokens=6, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, repetition_penalty=1.3),
    ]
    seqs = [
        core.make_sequences({"prompt_token_ids": p}, q)[0]
        for p, q in zip(prompts[:3], params[:3], strict=True)
    ]
    sampled = core.make_sequences({"prompt_token_ids": prompts[3]}, params[3])[0]
    penalized = core.make_sequences({"prompt_token_ids": [3, 3, 4]}, params[4])[0]
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
    a, b = (core.make_sequences({"prompt_token_ids": p}, params[0])[0] for p in prompts[:2])
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
    full = EngineCore(llm, SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64), async_scheduling=True)
    trio = [full.make_sequences({"prompt_token_ids": p}, params[0])[0] for p in prompts[:3]]
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
    import fp4moe.engine.spec_decode as spec_decode
    from fp4moe.engine.core import EngineCore
    from fp4moe.engine.scheduler import SchedulerConfig

    monkeypatch.setattr(spec_decode, "PROBE_ROUNDS", 2)  # short phases: every step runs Triton's interpreter
    monkeypatch.setattr(spec_decode, "BACKOFF_STEPS", 2)
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
    core = EngineCore(llm, SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=128), async_scheduling=True)
    params = SamplingParams(**{**vars(greedy), "logprobs": None})
    seqs = [core.make_sequences(p, params)[0] for p in prompts]
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
    assert not spec.head_pays()
    monkeypatch.setattr(spec_decode, "BACKOFF_STEPS", 4)  # its 4 steps after the first token, all backed off
    late = core.make_sequences(prompts[0], SamplingParams(**{**vars(params), "max_tokens": 5}))[0]
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
    from fp4moe.engine.core import EngineCore
    from fp4moe.engine.scheduler import SchedulerConfig

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
        core = EngineCore(llm, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=128))
        seqs = [
            core.make_sequences({"prompt_token_ids": p}, q)[0] for p, q in zip(PROMPTS, params, strict=True)
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
