"""Batch assembly: a flat forward over chosen token chunks of several sequences, logits for those whose
chunk reached their last token. Prompts may arrive in chunks (chunked prefill); images are placed by
counting the image tokens before each chunk."""

from __future__ import annotations

from collections.abc import Callable

import torch

from fp4moe.engine.reference.cache import DeltaNetStates, KVCache
from fp4moe.engine.reference.context import StepContext
from fp4moe.engine.reference.prompt_logprobs import score_chunk
from fp4moe.engine.request.sequence import Sequence


class ModelRunner:
    """The CPU path (the torch modules), and the runner protocol the engine relies on; ``CudaModelRunner``
    overrides what differs: ``max_num_seqs`` (state slots, None = unbounded), ``capacity_tokens()`` (KV
    tokens its caches hold, None = unbounded), ``spec_tokens`` (drafts its fused round verifies, 0 = no
    fused round), ``fusable_decode`` (whether a batch can take its fused decode step), ``capture`` and
    ``capture_prompts`` (its CUDA graphs of the decode step and of fresh prompts), ``whole_prompts`` (its
    fresh prompts are cheaper unsplit) and ``set_kv_scales`` (an fp8 cache's scales, fixed at start-up)."""

    max_num_seqs: int | None = None
    spec_tokens: int = 0
    use_prompt_graphs: bool = False  # fresh prompts through prefill graphs (the warm-up turns it off a while)

    def capacity_tokens(self) -> int | None:
        return None

    def fusable_decode(self, batch: list[tuple[Sequence, int]], kv) -> bool:
        return False

    def capture(self, batch_sizes=None, tick: Callable[[], None] | None = None) -> None:
        """No graphs on this path (``tick``: called after each graph captured)."""

    def capture_prompts(self, chunk_seqs: int | None = None, tick: Callable[[], None] | None = None) -> None:
        """No graphs on this path."""

    def pending_captures(self, batch_sizes=None) -> int:
        """How many graphs ``capture`` would capture now: none on this path."""
        return 0

    def pending_prompt_captures(self, chunk_seqs: int | None = None) -> int:
        """How many graphs ``capture_prompts`` would capture now: none on this path."""
        return 0

    def whole_prompts(self) -> bool:
        """Whether the scheduler should keep fresh prompts whole (``SchedulerConfig.whole_prompts``)."""
        return False

    def set_kv_scales(self, scales: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """An fp8 cache's scales {layer: (k, v)} (``engine.loading.kv_scales``), for every cache made from now on."""
        self.kv_scales = dict(scales)

    def __init__(self, model, image_token_id: int | None, device: torch.device, kv_cache_dtype: str = "auto"):
        self.model, self.image_token_id, self.device = model, image_token_id, device
        if kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv cache dtype must be 'auto' or 'fp8', got {kv_cache_dtype!r}")
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_scales: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.vocab_size = model.args.vocab_size

    def new_caches(self) -> tuple[KVCache, DeltaNetStates]:
        a = self.model.args
        states = DeltaNetStates(
            a.conv_dim,
            a.conv_kernel,
            a.linear_num_value_heads,
            a.linear_key_head_dim,
            a.linear_value_head_dim,
            self.model.embed_tokens.dtype,
            self.device,
        )
        return KVCache(self.kv_cache_dtype, self.kv_scales), states

    def _embeds(self, ids: torch.Tensor, batch: list[tuple[Sequence, int]], spans) -> torch.Tensor | None:
        with_images = [
            (s, n, sp)
            for (s, n), sp in zip(batch, spans, strict=True)
            if s.image_embeds is not None and s.num_cached < len(s.prompt_ids)
        ]
        if not with_images:
            return None
        embeds = self.model.embed(ids)
        for seq, n, (start, end) in with_images:
            chunk = torch.tensor(seq.tokens(seq.num_cached, seq.num_cached + n))
            mask = chunk == self.image_token_id
            if mask.any():
                before = sum(t == self.image_token_id for t in seq.prompt_ids[: seq.num_cached])
                rows = seq.image_embeds[before : before + int(mask.sum())].to(embeds.dtype)
                embeds[start:end][mask.to(embeds.device)] = rows
        return embeds

    @torch.no_grad()
    def forward(self, batch: list[tuple[Sequence, int]], kv: KVCache, states: DeltaNetStates):
        """Hidden states [T, H] of ``n`` uncached tokens of each (sequence, n), and each one's span in T.
        Caches are updated; ``num_cached`` is left to the caller."""
        chunks = [seq.tokens(seq.num_cached, seq.num_cached + n) for seq, n in batch]
        ids = torch.tensor([t for c in chunks for t in c], dtype=torch.long, device=self.device)
        positions = torch.cat(
            [
                s.positions(s.num_cached, s.num_cached + len(c))
                for (s, _), c in zip(batch, chunks, strict=True)
            ],
            dim=1,
        )
        ctx = StepContext(
            [len(c) for c in chunks], [s.num_cached for s, _ in batch], [s.slot for s, _ in batch], kv, states
        )
        spans = ctx.spans()
        hidden = self.hidden_states(ids, positions.to(self.device), ctx, self._embeds(ids, batch, spans))
        return hidden, spans

    def hidden_states(self, ids, positions, ctx, embeds=None) -> torch.Tensor:
        """The model's final-normed hidden states [T, H] of a flat batch (the GPU runner fuses the pieces
        between the layers' mixers)."""
        return self.model(ids, positions, ctx, inputs_embeds=embeds)

    @torch.no_grad()
    def run(
        self, batch: list[tuple[Sequence, int]], kv: KVCache, states: DeltaNetStates, keep=None
    ) -> list[tuple[Sequence, torch.Tensor]]:
        """Forward ``n`` uncached tokens of each (sequence, n); advances ``num_cached``; returns
        (sequence, logits [V] on the CPU) for every sequence that now has all its tokens cached. A sequence that
        asks for prompt logprobs gets those its chunk's rows give (``prompt_logprobs.score_chunk``).
        ``keep(seq, start, rows)``: called with each sequence's final-normed hidden states of this step
        [n, H] and the position of the first (the MTP head's inputs, ``MTPSpeculator``)."""
        hidden, spans = self.forward(batch, kv, states)
        done = []
        for (seq, n), (start, end) in zip(batch, spans, strict=True):
            if keep is not None:
                keep(seq, seq.num_cached, hidden[start:end])
            if seq.params.prompt_logprobs is not None and seq.num_cached < len(seq.prompt_ids):
                score_chunk(
                    seq, seq.num_cached, n, hidden[start:end], self.model.compute_logits, self.vocab_size
                )
            seq.num_cached += n
            if seq.num_cached == seq.num_tokens:
                done.append((seq, end - 1))
        if not done:
            return []
        logits = self.model.compute_logits(
            hidden[torch.tensor([i for _, i in done], device=self.device)]
        ).cpu()
        return [(seq, logits[k]) for k, (seq, _) in enumerate(done)]
