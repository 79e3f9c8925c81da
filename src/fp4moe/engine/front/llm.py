"""``LLM``: load a qwen3_5_moe checkpoint (bf16 or NVFP4) into our engine and generate.

All prompts of a call are prefilled together in one flat forward (no padding), then every unfinished
sequence advances one token per flat decode forward. Continuous batching across calls, paged caches and
CUDA graphs belong to the serving engine.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from fp4moe.engine.front.config import EngineConfig
from fp4moe.engine.loading.loader import load_model
from fp4moe.engine.loop.core import EngineCore, StepOutput
from fp4moe.engine.loop.scheduler import SchedulerConfig
from fp4moe.engine.reference.model_runner import ModelRunner
from fp4moe.engine.request.prompts import Prompts
from fp4moe.engine.request.sampler import SampleResult, SamplingParams, sample_batch
from fp4moe.engine.request.sequence import FinishReason, Sequence
from fp4moe.kernels import gpu_arch


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[SampleResult] | None = None


@dataclass
class RequestOutput:
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]


# num_speculative_tokens="auto" on the GPU engine with an MTP head (H200, full-size shapes, random weights,
# forced 80% acceptance: 1.3x at batch 1, 1.54-1.58x at batch 8, 1.40x at batch 32; BENCHMARKS.md); 0 on the
# CPU, where verification is compute-bound and speculation is slower than plain decoding
AUTO_SPECULATIVE_TOKENS = 2


class LLM:
    def __init__(self, model: str | Path, config: EngineConfig | None = None, **options):
        """``model``: a checkpoint directory; ``config`` (or its fields as keywords, which override it):
        how to run it (``EngineConfig``)."""
        config = replace(config or EngineConfig(), **options)
        self.engine_config = config
        self.path = Path(model)
        self.device = torch.device(config.device)
        gpu_arch.check(self.device)  # before the load: a GPU the kernels cannot run on says so at once
        self.limit_images = int((config.limit_mm_per_prompt or {}).get("image", 4))
        self._vision = None
        self.load_format = config.load_format
        # this GPU's recorded Triton variants compile in worker processes while the model loads
        # (``kernels.compile_seeds``); they are done before the KV cache is sized by the GPU's free memory
        self.precompile = _start_precompile(self.device, config.num_speculative_tokens)
        try:
            self.model, self.config = load_model(
                model,
                dtype=config.dtype,
                device=self.device,
                hf_overrides=config.hf_overrides,
                load_format=config.load_format,
            )
        except BaseException:
            if self.precompile is not None:
                self.precompile.cancel()
            raise
        args = self.model.args
        rope = args.rope
        limit = args.max_position_embeddings
        if rope.rope_type == "yarn":
            limit = max(limit, int(rope.factor * (rope.original_max_position_embeddings or limit)))
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(
                f"max_model_len {config.max_model_len} exceeds the model's {limit} positions "
                "(extend it with YaRN through hf_overrides)"
            )
        self.max_model_len = config.max_model_len or limit
        self.prompts = Prompts(
            self.path, self.config, args.vocab_size, self.max_model_len, self.limit_images, self.load_format
        )
        # detokenizes each new token (None: the engine hands out ids alone; the API front detokenizes)
        self.tokenizer = self.prompts.tokenizer
        k = config.num_speculative_tokens
        fused = self.device.type == "cuda" and self.model.embed_tokens.dtype == torch.bfloat16
        if k == "auto":  # where the fused round pays: the GPU engine, with an MTP head
            k = AUTO_SPECULATIVE_TOKENS if fused and self.model.mtp is not None else 0
        if k and config.speculative_draft_vocab and self.model.mtp is not None:
            from fp4moe.engine.spec.draft_vocab import draft_token_ids

            ids = draft_token_ids(
                args.vocab_size, config.speculative_draft_vocab, self.tokenizer, self.prompts.eos_ids
            )
            self.model.mtp.use_draft_vocab(self.model, ids)
        if config.max_num_seqs == "auto":
            config = replace(config, max_num_seqs=self._auto_max_num_seqs(k if fused else 0))
            self.engine_config = config
        image_token = self.config.get("image_token_id")
        image_token = int(image_token) if image_token is not None else None
        # paged caches, fused decode kernels, CUDA graphs; the kernels are bf16 (an fp32 model on the GPU,
        # a debugging/parity mode, runs the module path)
        if self.precompile is not None:
            self.precompile.wait()
        if self.device.type == "cuda" and self.model.embed_tokens.dtype == torch.bfloat16:
            from fp4moe.engine.runner.cuda_runner import CudaModelRunner

            self.runner = CudaModelRunner(
                self.model, image_token, self.device, config.kv_cache_dtype, max_num_seqs=config.max_num_seqs,
                max_model_len=self.max_model_len, gpu_memory_utilization=config.gpu_memory_utilization,
                cuda_graphs=config.cuda_graphs, spec_tokens=k if self.model.mtp is not None else 0,
                prefill_graph_tokens=config.graph_rows,
            )  # fmt: skip
        else:
            self.runner = ModelRunner(self.model, image_token, self.device, config.kv_cache_dtype)
        self.kv_scales_source: str | None = None  # where an fp8 cache's scales came from (printed at start)
        if config.kv_cache_dtype == "fp8":
            from fp4moe.engine.loading import kv_scales

            self.kv_scales_source = kv_scales.setup(self.runner, self.model, self.tokenizer, self.device)
        self.speculator = None
        if k:
            from fp4moe.engine.spec.spec_decode import MTPSpeculator

            self.speculator = MTPSpeculator(self, k)
            self.speculator.disable_by_batch_size = max(0, int(config.speculative_disable_by_batch_size))
        self.eos_ids = self.prompts.eos_ids
        self._warm_tokens = 0  # the step budget ``warmup`` ran for (0: not warmed up)
        self.warmup_phases: dict[str, float] = {}  # seconds by phase of the last ``warmup``
        self.warmup_steps = (0, 0)  # the last ``warmup``'s progress bar: (steps done, steps counted ahead)

    def _auto_max_num_seqs(self, spec_tokens: int) -> int:
        """``max_num_seqs="auto"``: memory-sized on the GPU (``memory.auto_max_num_seqs``), AUTO_CPU_SEQS on
        the CPU."""
        from fp4moe.engine.front.config import AUTO_CPU_SEQS

        if self.device.type != "cuda":
            return AUTO_CPU_SEQS
        from fp4moe.engine.device.memory import auto_max_num_seqs, state_bytes_per_sequence
        from fp4moe.engine.runner.cuda_runner import GRAPH_BATCH_SIZES

        per_seq = state_bytes_per_sequence(self.model.args, self.model.embed_tokens.dtype, spec_tokens)
        free, total = torch.cuda.mem_get_info(self.device)
        return auto_max_num_seqs(
            total, total - free, self.engine_config.gpu_memory_utilization, per_seq, GRAPH_BATCH_SIZES
        )

    # ----- prompts -----
    def _vision_tower(self):
        from fp4moe.formats.checkpoint import CheckpointReader
        from fp4moe.layers.vision import VisionTower

        if self._vision is None:
            self._vision = VisionTower(
                self.config["vision_config"],
                CheckpointReader(self.path),
                self.model.embed_tokens.dtype,
                self.device,
            )
        return self._vision

    def encode_images(self, seq: Sequence) -> None:
        """The vision tower's embeddings of a sequence's images in place of their pixels."""
        if seq.pixel_values is not None:
            embeds = self._vision_tower().encode(seq.pixel_values, seq.image_grid)
            seq.image_embeds, seq.pixel_values, seq.image_grid = torch.cat(embeds), None, None

    def _encode(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        return self.prompts.encode(prompt)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        return self.prompts.apply_chat_template(messages, add_generation_prompt, **kwargs)

    # ----- generation -----
    @functools.cached_property
    def max_cached_tokens(self) -> int:
        """KV tokens the scheduler may reserve: what the GPU runner's paged cache holds (sized from free
        memory), what free GPU memory allows on the module path (sized at the first generation), else the
        configured budget (default 2^20)."""
        requested = self.engine_config.max_cached_tokens or 1 << 20
        capacity = self.runner.capacity_tokens()
        if capacity is not None:
            return min(requested, capacity)
        if self.device.type != "cuda":
            return requested
        from fp4moe.engine.device.memory import (
            cache_budget_tokens,
            deltanet_bytes_per_sequence,
            kv_bytes_per_token,
        )

        free, total = torch.cuda.mem_get_info(self.device)
        cfg, dtype = self.engine_config, self.model.embed_tokens.dtype
        per_token = kv_bytes_per_token(self.model.args, cfg.kv_cache_dtype, dtype)
        per_seq = deltanet_bytes_per_sequence(self.model.args, dtype)
        budget = cache_budget_tokens(
            total, total - free, cfg.gpu_memory_utilization, per_token, per_seq, cfg.max_num_seqs
        )
        return min(requested, budget)

    def new_core(self, max_waiting: int = 1 << 30, prefix_cache=None) -> EngineCore:
        """The engine loop over this model (the runner's caches, a fresh scheduler): what ``generate`` steps
        through and what ``fp4moe serve`` runs on its engine thread."""
        cfg = self.engine_config
        slots = self.runner.max_num_seqs or cfg.max_num_seqs  # the GPU runner has that many state slots
        limits = SchedulerConfig(
            slots, cfg.max_num_batched_tokens, cfg.enable_chunked_prefill, max_waiting, self.max_cached_tokens,
            whole_prompts=self.runner.whole_prompts(),
        )  # fmt: skip
        return EngineCore(self, limits, prefix_cache, cfg.async_scheduling)

    def sample_all(self, results: list[tuple[Sequence, torch.Tensor]]) -> None:
        """Sample a token for each (sequence, logits [V], on the host or the device): one ``sample_batch``
        per device where the logits are (a mixed step has decodes' logits on the GPU, prefills' on the
        host), one read-back each."""
        for device in {x.device for _, x in results}:
            rows = [(s, x) for s, x in results if x.device == device]
            logits = torch.stack([x for _, x in rows])
            for (seq, _), result in zip(
                rows, sample_batch(logits, [s.sample_row() for s, _ in rows]), strict=True
            ):
                self._accept(seq, result)

    def _accept(self, seq: Sequence, result: SampleResult) -> None:
        seq.delta = seq.append(result, self.tokenizer)
        if not seq.finished and seq.num_tokens >= self.max_model_len:
            seq.finish_reason = FinishReason.LENGTH  # the context is full

    def _run(self, seqs: list[Sequence]) -> Iterator[list[StepOutput]]:
        """Step the engine loop until every sequence is finished, yielding each step's outputs (one per
        sequence that got tokens). Closing the iterator early (an error, an abandoned stream) aborts what
        is unfinished and frees its caches."""
        core = self.new_core()
        if self.speculator is not None:  # each call judges the draft head afresh: seeded outputs of a call do
            self.speculator.policy.forget()  # not depend on the calls before it (a server's core keeps learning)
        now = time.monotonic()
        for seq in seqs:
            seq.arrival = now
        core.add(seqs)
        try:
            while core.has_work():
                yield core.step()
        finally:  # everything the scheduler still holds, finished or not: a step that raised after marking a
            # sequence finished never released its slot, and the GPU runner's caches outlive this core
            for seq in list(core.scheduler.running) + list(core.scheduler.waiting):
                core.abort(seq)
            core.discard_inflight()

    def _make_sequences(
        self, prompts, params: list[SamplingParams]
    ) -> tuple[list[tuple[str | None, list[int]]], list[Sequence]]:
        """Prompts are text, token ids, or {"prompt" | "prompt_token_ids": ..., "multi_modal_data": {"image": ...}}."""
        return self.prompts.make_sequences(prompts, params, self.encode_images)

    def warmup(
        self, max_batch_tokens: int = 2048, prefix_caching: bool = False, progress: bool = True
    ) -> float:
        """Compile every kernel variant and capture every CUDA graph before the first request (vLLM's
        compile-and-capture phase; a cold server spent 45-68% of its first seconds in Triton's compiler and
        in graph captures, issue 20): greedy and sampled generations at every graph batch size, and prefills
        of lengths around each power of two up to ``max_batch_tokens`` (kernels specialize on 1, on
        multiples of 16 and on size buckets). Leaves the caches as it found them: every page freed, an fp8
        cache's scales unset (the first real prefill sets them). ``prefix_caching``: a prefix cache will serve
        the requests (each hit continues its prompt, several in a step: every chunk graph is captured; without
        one only a single prompt's). ``progress``: a progress bar on stderr, one step per generation or graph
        captured (a cold start on the H200 takes minutes). Returns the seconds it took; ``warmup_phases``
        holds them by phase (the server prints them)."""
        import time

        from tqdm.auto import tqdm

        from fp4moe.engine.runner.cuda_runner import GRAPH_BATCH_SIZES
        from fp4moe.kernels import compiles

        compiles.watch()
        start = time.perf_counter()
        stamps = [("", start)]  # (phase, when it ended)
        limit = min(max_batch_tokens, self.max_model_len - 4)
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
        module_path += [[[1] * (limit + x)] for x in (16, 17) if limit + x <= self.max_model_len - 4]
        module_path += [[[1] * n for n in lens] for lens in ((3, 6, 8), (5, 11))]
        width = self.runner.max_num_seqs or 1
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
        graphs, self.runner.use_prompt_graphs = self.runner.use_prompt_graphs, False
        try:
            for prompts in module_path:
                self.generate(prompts, greedy)
                step()
        finally:
            self.runner.use_prompt_graphs = graphs
        stamps.append(("module path", time.perf_counter()))
        phase("prompts through graphs")
        for n in lengths:  # then fresh prompts through the prefill graphs (each captured on first use)
            self.generate([[1] * n], greedy)
            step()
        stamps.append(("prompts through graphs", time.perf_counter()))
        phase("decode batches")
        for b in batches:
            self.generate([[1] * 4] * b, greedy)
            self.generate([[1] * 4] * b, sampled)
            step(2)
        stamps.append(("decode batches", time.perf_counter()))
        phase("decode graphs", self.runner.pending_captures())
        self.runner.capture(tick=step)  # the plain step's graphs (speculating warm-ups ran rounds)
        stamps.append(("decode graphs", time.perf_counter()))
        # without a prefix cache (offline, or a server without one) no step continues two prompts at once
        chunk_seqs = None if prefix_caching else 1
        phase("prefill graphs", self.runner.pending_prompt_captures(chunk_seqs))
        self.runner.capture_prompts(chunk_seqs=chunk_seqs, tick=step)
        self.warmup_steps = (steps[0], steps[1])  # equal: every count above was right (the tests check)
        bar.close()
        stamps.append(("prefill graphs", time.perf_counter()))
        self._warm_tokens = max_batch_tokens
        self.warm_thread()
        if self.speculator is not None:  # the warm-up's drafts are not the server's: neither in its counts
            self.speculator.forget()  # nor in the rounds that judge whether new requests start drafting
        compiles.mark()  # from here on, a compile is a request waiting for the compiler: warned and counted
        stamps.append(("the rest", time.perf_counter()))
        self.warmup_phases = {
            name: end - before for (_, before), (name, end) in zip(stamps[:-1], stamps[1:], strict=True)
        }
        return stamps[-1][1] - start

    def warm_thread(self) -> None:
        """What the warm-up fills per thread, for the thread that calls it (the server's engine thread, where
        the warm-up ran in another): cuDNN's attention plans for long fresh prompts, one per padded length
        (PyTorch keeps them thread-local). Nothing before ``warmup`` ran."""
        if self._warm_tokens:
            from fp4moe.layers.attention import warm_cudnn

            a = self.model.args
            warm_cudnn(self._warm_tokens, a.num_heads, a.num_kv_heads, a.head_dim, self.runner.device)

    def generate(
        self,
        prompts: str | list[str] | list[int] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        on_token: Callable[[int, int, str], None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for a batch of prompts (text or token ids). ``on_token(prompt_index, token, text_delta)``
        is called as tokens are produced."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        encoded, seqs = self._make_sequences(prompts, params)
        owner = [i for i, p in enumerate(params) for _ in range(p.n)]
        owner_of = {id(s): i for s, i in zip(seqs, owner, strict=True)}
        with contextlib.closing(self._run(seqs)) as run:  # a raising on_token frees the caches at once
            for outputs in run:
                if on_token is not None:
                    for out in outputs:
                        if out.new_tokens:
                            on_token(owner_of[id(out.seq)], out.seq.output_ids[-1], out.delta)
        outputs = []
        for i, (text, ids) in enumerate(encoded):
            mine = [s for s, o in zip(seqs, owner, strict=True) if o == i]
            outputs.append(
                RequestOutput(
                    text,
                    ids,
                    [
                        CompletionOutput(
                            j,
                            s.text,
                            s.output_ids,
                            s.finish_reason.value if s.finish_reason else None,
                            s.logprobs if s.params.logprobs is not None else None,
                        )
                        for j, s in enumerate(mine)
                    ],
                )
            )
        return outputs

    def stream(
        self, prompt: str | list[int] | dict, sampling_params: SamplingParams | None = None
    ) -> Iterator[str]:
        """Text deltas of one prompt as they are generated."""
        _, seqs = self._make_sequences([prompt], [sampling_params or SamplingParams()])
        # an abandoned stream frees its cache now, not whenever the inner generator is collected
        with contextlib.closing(self._run(seqs[:1])) as run:
            for outputs in run:
                delta = "".join(out.delta for out in outputs)
                if delta:
                    yield delta

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        **template_kwargs,
    ) -> list[RequestOutput]:
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = []
        for conv in conversations:
            images = [
                _image_of(part)
                for m in conv
                if isinstance(m.get("content"), list)
                for part in m["content"]
                if part.get("type") in ("image", "image_url")
            ]
            text = self.apply_chat_template(conv, **template_kwargs)
            prompts.append({"prompt": text, "multi_modal_data": {"image": images}} if images else text)
        return self.generate(prompts, sampling_params)


def _start_precompile(device: torch.device, num_speculative_tokens):
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


def _image_of(part: dict):
    """The image of a chat content part: {"type": "image", "image": X} or OpenAI's image_url form."""
    if part["type"] == "image":
        return part["image"]
    url = part["image_url"]
    return url["url"] if isinstance(url, dict) else url
