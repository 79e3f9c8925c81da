"""Before the first request: the start-up precompilation of this GPU's recorded Triton variants
(``start_precompile``, in worker processes while the model loads) and the warm-up (``WarmUp``) that compiles
every kernel variant and captures every CUDA graph through the offline front's ``generate``."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from fp4moe.engine.request.sampler import SamplingParams

if TYPE_CHECKING:
    from fp4moe.engine.front.llm import LLM


class WarmUp:
    """An ``LLM``'s warm-up (``run``) and what it leaves: the step budget it ran for (``tokens``; 0: not warmed
    up), its seconds by phase (``phases``) and its progress bar's count (``steps``: done, counted ahead)."""

    def __init__(self, llm: LLM):
        self.llm = llm
        self.tokens = 0
        self.phases: dict[str, float] = {}
        self.steps = (0, 0)

    def __call__(self, *args, **kwargs) -> float:
        """``llm.warmup(...)`` is ``llm.warmup.run(...)``."""
        return self.run(*args, **kwargs)

    def run(self, max_batch_tokens: int = 2048, prefix_caching: bool = False, progress: bool = True) -> float:
        """Compile every kernel variant and capture every CUDA graph before the first request (vLLM's
        compile-and-capture phase; a cold server spent 45-68% of its first seconds in Triton's compiler and
        in graph captures, issue 20): greedy and sampled generations at every graph batch size, and prefills
        of lengths around each power of two up to ``max_batch_tokens`` (kernels specialize on 1, on
        multiples of 16 and on size buckets). Leaves the caches as it found them: every page freed (an fp8
        cache's scales were set at start-up, before any write, and stay). ``prefix_caching``: a prefix cache will serve
        the requests (each hit continues its prompt, several in a step: every chunk graph is captured; without
        one only a single prompt's). ``progress``: a progress bar on stderr, one step per generation or graph
        captured (a cold start on the H200 takes minutes). Returns the seconds it took; ``phases``
        holds them by phase (the server prints them)."""
        from tqdm.auto import tqdm

        from fp4moe.engine.runner.cuda_runner import GRAPH_BATCH_SIZES
        from fp4moe.kernels import compiles

        llm = self.llm
        compiles.watch()
        start = time.perf_counter()
        stamps = [("", start)]  # (phase, when it ended)
        limit = min(max_batch_tokens, llm.max_model_len - 4)
        lengths = sorted(
            {n for p in range(12) for n in (2**p - 1, 2**p, 2**p + 1) if 1 <= n <= limit} | {limit}
        )
        greedy = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        sampled = SamplingParams(max_tokens=3, temperature=0.8, ignore_eos=True, seed=0)
        # the module path first (continuing chunks, several sequences' chunks in a step, images, an fp8
        # cache's first prefill take it): fresh prompts of every length, continuing chunks of a prompt longer
        # than a step of a length divisible by 16 and of one that is not (Triton specializes on both), and
        # several prompts in a step, again of both kinds of total
        module_path = [[[1] * n] for n in lengths]
        module_path += [[[1] * (limit + x)] for x in (16, 17) if limit + x <= llm.max_model_len - 4]
        module_path += [[[1] * n for n in lens] for lens in ((3, 6, 8), (5, 11))]
        width = llm.runner.max_num_seqs or 1
        batches = [b for b in GRAPH_BATCH_SIZES if b <= width]
        # steps done and counted ahead (a disabled bar counts none); the captures are counted as their phases
        # begin (the decode batches capture graphs on first use)
        steps = [0, len(module_path) + len(lengths) + 2 * len(batches)]
        bar = tqdm(total=steps[1], desc="warm-up", unit="step", disable=not progress, dynamic_ncols=True)

        def phase(name: str, captures: int = 0) -> None:
            bar.set_description(f"warm-up: {name}")
            steps[1] += captures
            bar.total = steps[1]
            bar.refresh()

        def step(n: int = 1) -> None:
            steps[0] += n
            bar.update(n)

        phase("module path")
        graphs, llm.runner.use_prompt_graphs = llm.runner.use_prompt_graphs, False
        try:
            for prompts in module_path:
                llm.generate(prompts, greedy)
                step()
        finally:
            llm.runner.use_prompt_graphs = graphs
        stamps.append(("module path", time.perf_counter()))
        phase("prompts through graphs")
        for n in lengths:  # then fresh prompts through the prefill graphs (each captured on first use)
            llm.generate([[1] * n], greedy)
            step()
        stamps.append(("prompts through graphs", time.perf_counter()))
        phase("decode batches")
        for b in batches:
            llm.generate([[1] * 4] * b, greedy)
            llm.generate([[1] * 4] * b, sampled)
            step(2)
        stamps.append(("decode batches", time.perf_counter()))
        phase("decode graphs", llm.runner.pending_captures())
        llm.runner.capture(tick=step)  # the plain step's graphs (speculating warm-ups ran rounds)
        stamps.append(("decode graphs", time.perf_counter()))
        # without a prefix cache (offline, or a server without one) no step continues two prompts at once
        chunk_seqs = None if prefix_caching else 1
        phase("prefill graphs", llm.runner.pending_prompt_captures(chunk_seqs))
        llm.runner.capture_prompts(chunk_seqs=chunk_seqs, tick=step)
        self.steps = (steps[0], steps[1])  # equal: every count above was right (the tests check)
        bar.close()
        stamps.append(("prefill graphs", time.perf_counter()))
        self.tokens = max_batch_tokens
        self.warm_thread()
        if llm.speculator is not None:  # the warm-up's drafts are not the server's: neither in its counts
            llm.speculator.forget()  # nor in the rounds that judge whether new requests start drafting
        compiles.mark()  # from here on, a compile is a request waiting for the compiler: warned and counted
        stamps.append(("the rest", time.perf_counter()))
        self.phases = {
            name: end - before for (_, before), (name, end) in zip(stamps[:-1], stamps[1:], strict=True)
        }
        return stamps[-1][1] - start

    def warm_thread(self) -> None:
        """What the warm-up fills per thread, for the thread that calls it (the server's engine thread, where
        the warm-up ran in another): cuDNN's attention plans for long fresh prompts, one per padded length
        (PyTorch keeps them thread-local). Nothing before ``warmup`` ran."""
        if self.tokens:
            from fp4moe.layers.attention import warm_cudnn

            llm = self.llm
            a = llm.model.args
            warm_cudnn(self.tokens, a.num_heads, a.num_kv_heads, a.head_dim, llm.runner.device)


def start_precompile(device: torch.device, num_speculative_tokens):
    """``compile_seeds.start`` for a CUDA device where Triton is installed (the variants recorded for plain
    decoding or for speculation; "auto": both), else None."""
    from fp4moe.kernels import HAVE_TRITON

    if device.type != "cuda" or not HAVE_TRITON:
        return None
    from fp4moe.kernels import compile_seeds

    return compile_seeds.start(
        torch.cuda.get_device_name(device),
        compile_seeds.cuda_target(device),
        config=compile_seeds.config_of(num_speculative_tokens),
    )
