"""The GPU runner's fused decode step (paged caches, fused kernels) against the module path.

Without CUDA the kernels run under Triton's interpreter on the CPU (graphs off); with CUDA the same test
runs on the GPU with graphs on. Both paths compute in bf16 but in different orders (the interpreter's dots are
numpy's, so OpenBLAS's kernel for the CPU at hand; the GPU's are cuBLAS's and ours), so greedy tokens must
agree up to a near tie of the reference no wider than the measured drift (``runner_cases._agree``): a split
ends that sequence's comparison, and each check says how many tokens it compared."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from runner_cases import DEV, MIXED, PROMPTS, _agree, _all_pages_back, _emulate_graphs, _fused  # noqa: E402

from fp4moe.engine.front.llm import LLM  # noqa: E402
from fp4moe.engine.request.sampler import SamplingParams  # noqa: E402
from fp4moe.engine.runner.cuda_runner import CudaModelRunner  # noqa: E402
from fp4moe.layers.moe import SparseMoE  # noqa: E402


@pytest.mark.parametrize(
    "which,fused_prefill", [("bf16", False), ("nvfp4", False), ("mixed", False), ("nvfp4", True)]
)
def test_fused_decode_gives_the_module_paths_greedy_tokens(checkpoints, which, fused_prefill, monkeypatch):
    """The fused decode step (prompts prefilled by the modules: within the decode step's measured drift,
    ``runner_cases.DECODE``), and the fused prefill (its expert sum is fp32 where the CPU modules add bf16 per
    expert, as transformers does: ``FUSED_PREFILL``)."""
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
    _agree(expected, got, fused_prefill=fused_prefill)
    assert calls  # the decode steps took the fused path (on CUDA: the warm-up before each capture) ...
    assert bool(llm.runner.graphs) == (DEV == "cuda")  # ... and on CUDA the captured graphs replayed it
    assert _all_pages_back(llm.runner)


def test_fused_decode_logits_close_with_an_fp8_cache(checkpoints):
    """Decode steps within the decode step's drift (prompts through the modules); then the fused prefill too,
    which sets each layer's fp8 scales from its own keys/values: within the fused prefill's. On the GPU the
    engine as served (fused prefill, graphs) within the fp8 cache's measured GPU drift (``GPU_FP8``)."""
    from runner_cases import GPU_FP8

    path = checkpoints.quantized()
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=2)
    ref = LLM(path, dtype="bfloat16", device="cpu", kv_cache_dtype="fp8")
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    expected = ref.generate(prompts, params)
    if DEV == "cuda":
        llm = LLM(path, dtype="bfloat16", device="cuda", kv_cache_dtype="fp8")
        _agree(expected, llm.generate(prompts, params), bounds=GPU_FP8)
        assert llm.runner.graphs and _all_pages_back(llm.runner)
        return
    llm = LLM(path, dtype="bfloat16", device="cpu", kv_cache_dtype="fp8")
    _fused(llm, "fp8")
    _agree(expected, llm.generate(prompts, params))
    llm = LLM(path, dtype="bfloat16", device="cpu", kv_cache_dtype="fp8")
    _fused(llm, "fp8")
    llm.runner.fused_prefill = True
    _agree(expected, llm.generate(prompts, params), fused_prefill=True)


def test_serving_engine_with_prefix_caching_on_the_paged_caches(checkpoints):
    """Continuous batching + prefix caching through the GPU runner's paged caches (snapshots of pages and
    state slots) gives the module path's tokens; every page is returned at the end."""
    from fp4moe.engine.loop.prefix_cache import PrefixCache
    from fp4moe.engine.loop.scheduler import SchedulerConfig

    path = checkpoints.quantized()
    p = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=2)
    base = list(range(100, 140))
    prompts = [base, base + [7, 8, 9], [3, 4]]
    ref = LLM(path, dtype="bfloat16", device="cpu").generate([{"prompt_token_ids": x} for x in prompts], p)
    llm = LLM(path, dtype="bfloat16", device=DEV)
    if DEV == "cpu":
        _fused(llm)
    pc = PrefixCache(block_size=16, max_entries=8)
    core = llm.new_core(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=32), prefix_cache=pc)
    seqs = [llm.make_sequences({"prompt_token_ids": x}, p)[0] for x in prompts]
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
    from fp4moe.engine.loop.scheduler import SchedulerConfig
    from fp4moe.engine.reference.model_runner import ModelRunner

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
    core = llm.new_core(SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=16))
    seqs = [llm.make_sequences({"prompt_token_ids": x}, p)[0] for x in prompts]
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
    """``_prompt_groups`` (``prompt_buckets.partition``): a served step's fifteen prompts of 466-530 tokens take one 16 x 576 graph (9,216
    rows, the default limit for an 8,192-token step) where they took two 8 x 576 ones and a 1 x 512; at
    8,192 rows, two graphs and no third; a short prompt beside a much longer one stays alone only when its
    padding would cost more than a replay. Against every split of the sorted prompts into consecutive groups
    (all 2^(n-1) of them, random lengths): never more rows + REPLAY_ROWS per replay, and each prompt in one
    group whose graph holds it. (Only splits into full groups but the last are weighed: the brute force
    checks that this loses nothing.)"""
    import itertools
    import random

    from fp4moe.engine.runner.prompt_buckets import REPLAY_ROWS

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
    chunk (3 tokens after 3 cached, in the 1 x 16-row graph of chunks over cached prefixes: paged attention
    over its prefix, the slot's states), against the same runner's eager prefill (``hidden_states``) of the
    same step: the same hidden states, keys/values and Gated DeltaNet states up to rounding (the padded rule
    and the fused projections sum in another order), the padding's keys/values nowhere but the scratch page
    (every other page as it was). The padding is what could go wrong: its decay and write strength are
    masked, or the states would have run on for the padded rows. (Tokens through the graphs: the GPU runs of
    this file.)"""
    from fp4moe.engine.request.sequence import Sequence

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
        assert sorted(runner.chunk_graphs) == ([(1, 16)] if graphs else [])
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
def test_a_prefill_graph_captured_without_an_eager_run_first(checkpoints, monkeypatch):
    """Once a prefill graph's kernels are compiled, the next capture of that shape skips the eager run
    (``compiles.forbidden`` found nothing to compile) and replays bit for bit what a graph captured after an
    eager run does: the same hidden states and keys/values for the same two prompts (same kernels, same
    order: exact). A capture that would compile falls back to the eager run first."""
    from contextlib import contextmanager

    from fp4moe.engine.request.sequence import Sequence
    from fp4moe.engine.runner import cuda_runner
    from fp4moe.kernels import compiles

    llm = LLM(checkpoints.quantized(), dtype="bfloat16", device="cuda", max_num_seqs=8)
    runner, kv, shape = llm.runner, llm.runner.kv, (2, 32)
    runner._capture_prompt(1, 16)  # the pool's first graph (never captured directly)
    runner._capture_prompt(*shape)  # compiles what the shape needs (eagerly, or it was compiled already)
    first = runner.prompt_graphs.pop(shape)  # (kept: a graph's pool memory goes with it)
    direct = runner.direct_captures
    runner._capture_prompt(*shape)
    assert runner.direct_captures == direct + 1
    graphs = {"direct": runner.prompt_graphs.pop(shape)}

    @contextmanager
    def wants_a_compile():
        raise compiles.CompileWanted("as if a kernel were new")
        yield

    monkeypatch.setattr(cuda_runner.compiles, "forbidden", wants_a_compile)
    runner._capture_prompt(*shape)
    assert runner.direct_captures == direct + 1  # the fallback ran eagerly first
    graphs["eager first"] = runner.prompt_graphs.pop(shape)
    prompts, out = [list(range(7, 27)), list(range(100, 131))], {}
    for i, (name, graph) in enumerate(graphs.items()):
        runner.prompt_graphs[shape] = graph
        seqs = [
            Sequence(10 + 2 * i + j, p, SamplingParams(max_tokens=1), slot=2 * i + j)
            for j, p in enumerate(prompts)
        ]
        hidden = runner._run_prompt_graph([(s, len(s.prompt_ids)) for s in seqs], *shape)
        keys = [
            kv.k.view(kv.k.shape[0], -1, *kv.k.shape[3:])[:, kv.rows(s.slot, 0, len(s.prompt_ids))]
            for s in seqs
        ]
        out[name] = [h.clone() for h in hidden] + [k.clone() for k in keys]
        del runner.prompt_graphs[shape]
    assert all(torch.equal(a, b) for a, b in zip(out["direct"], out["eager first"], strict=True))
    del first


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
    took = llm.warmup.run(256)
    phases = (
        "module path",
        "prompts through graphs",
        "decode batches",
        "decode graphs",
        "prefill graphs",
        "the rest",
    )
    assert tuple(llm.warmup.phases) == phases and sum(llm.warmup.phases.values()) == pytest.approx(took)
    done, total = llm.warmup.steps
    assert done == total > 0  # the progress bar counted every generation and capture ahead
    assert llm.runner.direct_captures > 0  # prefill graphs whose kernels were compiled skipped the eager run
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
