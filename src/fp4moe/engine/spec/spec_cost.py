"""Whether speculation pays at the batch it runs in, measured as the engine runs.

The per-sequence policy (``SpecPolicy.judge``) asks whether a round's drafts are accepted often enough,
against a fixed break-even (a round costing ~1.9 plain steps at batch 1, ~1.4 at 8-32 on the H200). What a
round costs depends on the batch and the context too: at 16 streams of 8K-token prompts on the H200 a round
with k = 2 verified 48 rows (on random routing, most of every layer's 256 experts) and attended them over 8K
keys, and speculation at 69% acceptance served 14% fewer tokens than plain steps (BENCHMARKS.md, "Prefill
graphs for chunks over cached prefixes"). So the GPU runner also times its fused rounds and its plain steps
by batch-size bucket (CUDA events around each, read once done: no sync) and after every round compares
tokens per millisecond: a round's mean tokens per sequence (its accepted drafts + 1) over the median of the
latest ``WINDOW`` rounds' times, against one token over the plain step's time at the same bucket. Where
rounds lose, the batch's sequences decode plainly for ``backoff`` steps (the per-sequence policy's backoff,
then they probe again); where a window of rounds is in but no plain step at the bucket has been timed (in the
latest ``PLAIN_EVERY`` rounds), they take one plain step (~1 step in 64; plain steps taken anyway, beside
top-p sequences or backed off, count too)."""

from __future__ import annotations

import statistics
from collections import defaultdict, deque
from contextlib import contextmanager

import torch

WINDOW = 8  # rounds judged together at a bucket
PLAIN_EVERY = 64  # rounds at a bucket before its plain step's time is refreshed by one plain step
ALPHA = 0.25  # weight of the newest plain step's time in its running estimate


def batch_bucket(n: int) -> int:
    """The CUDA-graph batch bucket that a batch of ``n`` sequences replays (its cost's key)."""
    from fp4moe.engine.runner.cuda_runner import GRAPH_BATCH_SIZES

    return next((g for g in GRAPH_BATCH_SIZES if g >= n), n)


class SpecCost:
    """Rounds' and plain steps' GPU times by batch bucket; ``verdict`` after each round. ``enabled`` False
    (the CPU): nothing is timed and every verdict is None."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._pending: deque = deque()  # (kind, sequences, start event, end event), oldest first
        self.plain_ms: dict[int, float] = {}
        self.round_ms: dict[int, list[float]] = defaultdict(list)
        self.tokens: dict[int, list[float]] = defaultdict(list)
        self.rounds_since_plain: dict[int, int] = defaultdict(int)
        self.probing: set[int] = set()  # buckets whose plain step is asked for and not yet timed

    @contextmanager
    def timed(self, kind: str, n: int):
        """Time the GPU work enqueued inside (``kind``: "round" or "plain", for ``n`` sequences)."""
        if not self.enabled:
            yield
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self._pending.append((kind, n, start, end))
        self.poll()  # what is done by now (a server of plain steps alone never asks for a verdict)

    def add(self, kind: str, n: int, ms: float) -> None:
        """One measured time (``timed``'s, once its events are done; tests give their own)."""
        b = batch_bucket(n)
        if kind == "plain":
            self.plain_ms[b] = ms if b not in self.plain_ms else (1 - ALPHA) * self.plain_ms[b] + ALPHA * ms
            self.rounds_since_plain[b] = 0
            self.probing.discard(b)
        else:
            self.round_ms[b] = [*self.round_ms[b][1 - WINDOW :], ms]
            self.rounds_since_plain[b] += 1

    def poll(self) -> None:
        """Read the timed work that has finished, in order (the first unfinished one stops the read)."""
        while self._pending and self._pending[0][3].query():
            kind, n, start, end = self._pending.popleft()
            self.add(kind, n, start.elapsed_time(end))

    def verdict(self, n: int, tokens_per_seq: float) -> str | None:
        """After a round of ``n`` sequences that appended ``tokens_per_seq`` each on average (accepted drafts
        + 1), once ``WINDOW`` rounds at its bucket are in: "plain" (take one plain step: the bucket's plain
        time is missing or stale), "loses" (the latest rounds appended fewer tokens per millisecond than
        plain steps do; the window starts afresh), or None (speculate on)."""
        if not self.enabled:
            return None
        b = batch_bucket(n)
        self.tokens[b] = [*self.tokens[b][1 - WINDOW :], tokens_per_seq]
        self.poll()
        rounds, tokens = self.round_ms[b], self.tokens[b]
        if len(rounds) < WINDOW or len(tokens) < WINDOW:
            return None
        if b in self.probing:
            return None  # (a round run ahead of the probe's step)
        if b not in self.plain_ms or self.rounds_since_plain[b] >= PLAIN_EVERY:
            self.probing.add(b)
            return "plain"
        if statistics.fmean(tokens) / statistics.median(rounds) < 1 / self.plain_ms[b]:
            rounds.clear()
            tokens.clear()
            return "loses"
        return None
