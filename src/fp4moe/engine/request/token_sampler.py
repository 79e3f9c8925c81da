"""``TokenSampler``: a step's logits into tokens appended to their sequences -- the collaborator that the engine
loop and the speculator sample through (it holds the tokenizer that detokenizes each new token and the
context length that ends a sequence), so neither reaches back into a front for it."""

from __future__ import annotations

import torch

from fp4moe.engine.request.sampler import SampleResult, sample_batch
from fp4moe.engine.request.sequence import FinishReason, Sequence


class TokenSampler:
    def __init__(self, tokenizer, max_model_len: int):
        # detokenizes each new token (None: the engine hands out ids alone; the API front detokenizes)
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

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
                self.accept(seq, result)

    def accept(self, seq: Sequence, result: SampleResult) -> None:
        """Append a sampled token (its text delta in ``seq.delta``); a full context ends the sequence."""
        seq.delta = seq.append(result, self.tokenizer)
        if not seq.finished and seq.num_tokens >= self.max_model_len:
            seq.finish_reason = FinishReason.LENGTH  # the context is full

    def extend(self, seq: Sequence, results: list[SampleResult]) -> None:
        """Append a speculative round's tokens (``Sequence.extend``; their text delta in ``seq.delta``)."""
        seq.delta = seq.extend(results, self.tokenizer)
