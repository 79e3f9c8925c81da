"""Per-step context of a flat batch: where each sequence's tokens are, how many it has cached, its slot."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

from fp4moe.engine.cache import DeltaNetStates, KVCache


@dataclass
class StepContext:
    query_lens: list[int]  # tokens of each sequence in this step
    cached_lens: list[int]  # tokens of each sequence already in the caches
    slots: list[int]  # cache / state slot of each sequence
    kv: KVCache
    deltanet: DeltaNetStates

    def spans(self) -> list[tuple[int, int]]:
        """[start, end) of each sequence in the flat batch."""
        ends = list(accumulate(self.query_lens))
        return [(e - n, e) for e, n in zip(ends, self.query_lens, strict=True)]
