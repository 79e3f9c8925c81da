"""A sequence being generated: its tokens, parameters, slot, stop handling and outputs."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from fp4moe.engine.request.sampler import SampleResult, SampleRow, SamplingParams

MAX_WINDOW = 16  # tokens an incremental decode may span before the whole text is decoded instead


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"


@dataclass
class Sequence:
    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    slot: int
    eos_ids: frozenset[int] = frozenset()
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[SampleResult] = field(default_factory=list)
    # with params.prompt_logprobs: one per prompt token scored so far, the first with logprob None
    prompt_logprobs: list[SampleResult] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    num_cached: int = 0
    generator: torch.Generator | None = None
    prompt_positions: torch.Tensor | None = None  # [3, prompt_len] when the prompt holds images
    rope_delta: int = 0  # position of token i after the prompt = i + rope_delta
    image_embeds: torch.Tensor | None = None  # [image tokens, hidden], in prompt order
    # the images' pixels and patch grids [n, 3] until the engine's vision tower encodes them (image_embeds)
    pixel_values: torch.Tensor | None = None
    image_grid: torch.Tensor | None = None
    delta: str = ""  # text made final by the last token
    emitted: int = 0  # characters of ``text`` already handed out as deltas
    arrival: float = 0.0  # monotonic time the request arrived (serving)
    last_token_time: float | None = None
    stop_at: int = 0  # prefill stops here first (a prefix-cache snapshot boundary); 0 = no stop
    # speculation's online acceptance (SpecPolicy.judge): fused rounds since the last judgement, drafts
    # accepted in each of the latest rounds since the probe began, and plain steps left before the next
    # probe when drafting did not pay
    spec_rounds: int = 0
    spec_accepted: list[int] = field(default_factory=list)
    spec_backoff: int = 0
    # speculation's inputs for the MTP head (MTPSpeculator.run_batch): the target's hidden states the
    # head has not consumed yet, how many positions it has, the drafts kept for the next fused round
    hidden_tail: torch.Tensor | None = None
    mtp_cached: int = 0
    drafts: list[int] | None = None
    new_tokens: int = 1  # tokens the last step appended (a speculative round may add several)
    # incremental detokenization (``_detokenize``): text of output_ids[:_read] is final; the next decode starts
    # at _prefix (the token before, for context)
    _committed: str = field(default="", repr=False)
    _prefix: int = field(default=0, repr=False)
    _read: int = field(default=0, repr=False)

    def __post_init__(self):
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    def sample_row(self) -> SampleRow:
        """What the batched sampler needs of this sequence."""
        return SampleRow(self.params, self.prompt_ids, self.output_ids, self.generator)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def all_ids(self) -> list[int]:
        """Prompt and output as one new list (O(length): the engine's per-step paths use ``num_tokens``,
        ``token`` and ``tokens``, which copy nothing)."""
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token(self, i: int) -> int:
        """Token ``i`` of prompt + output (``i`` < 0 counts from the end)."""
        n = len(self.prompt_ids)
        i = i + self.num_tokens if i < 0 else i
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens start..end-1 of prompt + output (0 <= start <= end)."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.prompt_ids[start:] + self.output_ids[: end - n]

    def positions(self, start: int, end: int) -> torch.Tensor:
        """mRoPE positions [3, end - start] of tokens start..end-1."""
        if self.prompt_positions is None:
            return torch.arange(start, end).expand(3, -1)
        n = len(self.prompt_ids)
        inside = self.prompt_positions[:, start : min(end, n)]
        after = (
            torch.arange(max(start, n), max(end, n)).expand(3, -1) + self.rope_delta
        )  # a chunk may end inside
        return torch.cat([inside, after], dim=1)

    def append(self, result: SampleResult, tokenizer) -> str:
        """Add a sampled token, update text and finish state; returns the text that is now final (the
        streaming delta). Text that may still change is held back: a trailing incomplete UTF-8 character
        (decoded as U+FFFD) and, while stop strings are set, the last len(longest stop) - 1 characters."""
        token = result.token_id
        self.output_ids.append(token)
        if self.params.logprobs is not None:
            self.logprobs.append(result)
        before = len(self.text)
        if tokenizer is not None:
            self._detokenize(tokenizer)
        if (
            (token in self.eos_ids and not self.params.ignore_eos)
            or token in self.params.stop_token_ids
            or self.params.stop
            and self._cut_at_stop_string(before)
        ):
            self.finish_reason = FinishReason.STOP
        elif len(self.output_ids) >= self.params.max_tokens:
            self.finish_reason = FinishReason.LENGTH
        final = len(self.text)
        if not self.finished:
            final = len(self.text.rstrip("\ufffd"))
            if self.params.stop:
                final = min(final, len(self.text) - max(len(s) for s in self.params.stop) + 1)
        final = max(final, self.emitted)
        delta, self.emitted = self.text[self.emitted : final], final
        return delta

    def extend(self, results, tokenizer) -> str:
        """``append`` each of several tokens (SampleResults: a speculative round's) until one ends the
        sequence; returns their streaming delta (the count that went in is the growth of ``output_ids``)."""
        delta = ""
        for result in results:
            delta += self.append(result, tokenizer)
            if self.finished:
                break
        return delta

    def _detokenize(self, tokenizer) -> None:
        """``text`` = decode(output_ids), decoding only the tokens since the last complete character with
        one token before them for context (vLLM's incremental detokenization). A full decode per token
        costs O(length) -- 0.28 ms at 1,024 tokens, per sequence and step (BENCHMARKS.md) -- this one
        O(1). Where the window's decode does not extend its context's (a decoder that is not
        concatenative) or bytes never complete a character for MAX_WINDOW tokens, the whole text is decoded."""
        ids = self.output_ids
        context = tokenizer.decode(ids[self._prefix : self._read], skip_special_tokens=True)
        window = tokenizer.decode(ids[self._prefix :], skip_special_tokens=True)
        no_context = self._prefix > 0 and not context  # a skipped special token: a decoder that strips the
        # leading space of a first token (SentencePiece's Metaspace) would then drop the new text's
        if no_context or len(ids) - self._prefix > MAX_WINDOW or not window.startswith(context):
            self.text = tokenizer.decode(ids, skip_special_tokens=True)
            if not self.text.endswith("\ufffd"):  # the last token is the next window's context
                self._committed, self._prefix, self._read = self.text, len(ids) - 1, len(ids)
            return
        self.text = self._committed + window[len(context) :]
        if not window.endswith("\ufffd"):  # a complete character: final
            self._committed, self._prefix, self._read = self.text, self._read, len(ids)

    def _cut_at_stop_string(self, previous_len: int) -> bool:
        longest = max(len(s) for s in self.params.stop)
        search_from = max(0, previous_len - longest + 1)
        hits = [(self.text.find(s, search_from), s) for s in self.params.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return False
        index, stop = min(hits)
        self.text = (
            self.text[: index + len(stop)] if self.params.include_stop_str_in_output else self.text[:index]
        )
        return True
