"""``LLM``: the offline front -- load a qwen3_5_moe checkpoint (bf16 or NVFP4), build the engine's parts (model
runner, sampler, speculator) and an ``EngineCore`` over them, and generate (``generate`` / ``stream`` /
``chat``). The server's fronts (``async_engine``, ``process``) take the same parts from it and drive their own
core; the core never calls back into this front. Warm-up and precompilation: ``warmup``.
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
from fp4moe.engine.front.warmup import WarmUp, start_precompile
from fp4moe.engine.loading.loader import load_model
from fp4moe.engine.loop.core import EngineCore, StepOutput
from fp4moe.engine.loop.scheduler import SchedulerConfig
from fp4moe.engine.reference.model_runner import ModelRunner
from fp4moe.engine.request.prompts import Prompts
from fp4moe.engine.request.sampler import SampleResult, SamplingParams
from fp4moe.engine.request.sequence import Sequence
from fp4moe.engine.request.token_sampler import TokenSampler
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
        self.precompile = start_precompile(self.device, config.num_speculative_tokens)
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
        self.tokenizer = self.prompts.tokenizer
        # samples the logits and appends the tokens, detokenized (``core``'s and the speculator's)
        self.sampler = TokenSampler(self.tokenizer, self.max_model_len)
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

            self.speculator = MTPSpeculator(self.model, self.runner, self.sampler, k, name=str(self.path))
            self.speculator.disable_by_batch_size = max(0, int(config.speculative_disable_by_batch_size))
        self.eos_ids = self.prompts.eos_ids
        self.warmup = WarmUp(self)  # ``warmup.run()``: compile and capture before the first request

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

    def new_core(
        self,
        limits: SchedulerConfig | None = None,
        prefix_cache=None,
        async_scheduling: bool | None = None,
        max_waiting: int = 1 << 30,
    ) -> EngineCore:
        """The engine loop over this model's parts (the runner and its caches, the sampler, the speculator; a
        fresh scheduler): what ``generate`` steps through and what ``fp4moe serve`` runs on its engine thread
        or process. ``limits``: the scheduler's (default: from the engine config, ``max_waiting`` requests
        waiting at most); ``async_scheduling``: default the engine config's."""
        cfg = self.engine_config
        if limits is None:
            slots = self.runner.max_num_seqs or cfg.max_num_seqs  # the GPU runner has that many state slots
            limits = SchedulerConfig(
                slots, cfg.max_num_batched_tokens, cfg.enable_chunked_prefill, max_waiting,
                self.max_cached_tokens, whole_prompts=self.runner.whole_prompts(),
            )  # fmt: skip
        if async_scheduling is None:
            async_scheduling = cfg.async_scheduling
        return EngineCore(self.runner, self.sampler, limits, self.speculator, prefix_cache, async_scheduling)

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

    def make_sequences(self, prompt, params: SamplingParams) -> list[Sequence]:
        """Encode one prompt (text, ids or a multimodal dict) into ``params.n`` sequences to ``add`` to a core
        of this model (may raise; the images through the vision tower), as ``AsyncEngine.make_sequences``
        does for the server."""
        _, seqs = self._make_sequences([prompt], [params])
        now = time.monotonic()
        for seq in seqs:
            seq.arrival, seq.last_token_time, seq.slot = now, None, -1
        return seqs

    def _make_sequences(
        self, prompts, params: list[SamplingParams]
    ) -> tuple[list[tuple[str | None, list[int]]], list[Sequence]]:
        """Prompts are text, token ids, or {"prompt" | "prompt_token_ids": ..., "multi_modal_data": {"image": ...}}."""
        return self.prompts.make_sequences(prompts, params, self.encode_images)

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


def _image_of(part: dict):
    """The image of a chat content part: {"type": "image", "image": X} or OpenAI's image_url form."""
    if part["type"] == "image":
        return part["image"]
    url = part["image_url"]
    return url["url"] if isinstance(url, dict) else url
