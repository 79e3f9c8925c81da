"""Continuous batching: requests join and leave every step; chunked prefill shares a token budget with
decodes; FIFO admission with a bounded waiting queue; preemption by recompute when the cache is full.

Each step first gives every running sequence that has finished its prefill one decode token, then
continues unfinished prefills, then admits waiting sequences in arrival order while sequence slots and
tokens remain (a prompt larger than what is left is split when chunked prefill is on; otherwise it waits,
and nothing behind it jumps the queue). With ``whole_prompts`` a fresh prompt that a step beside the
running decodes could take whole waits for the next step rather than be split: the GPU runner prefills
fresh prompts through captured graphs, but a continuing chunk takes the module path (~150 ms of host work
at full size on the H200, however short the chunk). The cache budget counts cached tokens; when a step would exceed it,
the most recently admitted running sequence is preempted: its caches are freed and it goes back to the
front of the queue to be recomputed (its generated tokens are kept). Without a prefix cache one prompt at most
is split at a time, so no step continues two (the GPU warm-up captures chunk graphs of one sequence then).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from fp4moe.engine.request.sequence import FinishReason, Sequence


class QueueFullError(RuntimeError):
    pass


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    max_waiting: int = 256
    max_cached_tokens: int = 1 << 20
    whole_prompts: bool = False  # do not split a fresh prompt that the next step can take whole

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_waiting", "max_cached_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


class Scheduler:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.free_slots = list(range(config.max_num_seqs - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self.num_preemptions = 0
        self.cache_full: list[Sequence] = []  # ended because the cache cannot hold them (reported once)

    # predicate / action pairs
    def can_add(self) -> bool:
        return len(self.waiting) < self.config.max_waiting

    def check_fits(self, seq: Sequence) -> None:
        check_fits(seq, self.config)

    def add(self, seq: Sequence) -> None:
        if not self.can_add():
            raise QueueFullError(f"the waiting queue is full ({self.config.max_waiting} requests)")
        self.check_fits(seq)
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def cached_tokens(self) -> int:
        return sum(s.num_cached for s in self.running)

    def reserved_tokens(self) -> int:
        """Cache the running sequences will hold once their current tokens are all in (prefills included)."""
        return sum(s.num_tokens for s in self.running)

    def _release(self, seq: Sequence, release) -> None:
        release(seq.slot)
        self.free_slots.append(seq.slot)
        seq.slot = -1

    def schedule(self, release, on_admit=None) -> list[tuple[Sequence, int]]:
        """The (sequence, number of tokens) to run this step; ``release(slot)`` frees a slot's caches;
        ``on_admit(seq)`` runs when a sequence gets its slot (prefix-cache restore). A sequence's chunk never
        runs past ``seq.stop_at`` (a prefix snapshot boundary) while it is below it."""
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        batch: list[tuple[Sequence, int]] = []
        decoding = [s for s in self.running if s.num_cached == s.num_tokens - 1]
        # preempt (newest first) while the step's new tokens do not fit in the cache
        while decoding and self.reserved_tokens() > cfg.max_cached_tokens:
            victim = self.running.pop()
            self._release(victim, release)
            victim.num_cached = 0
            if not self.running:  # alone and still too long for the cache: it can never continue
                victim.finish_reason = FinishReason.LENGTH
                self.cache_full.append(victim)
                decoding = []
                break
            self.waiting.appendleft(victim)
            self.num_preemptions += 1
            decoding = [s for s in self.running if s.num_cached == s.num_tokens - 1]
        scheduled = set()
        for seq in decoding[:budget]:
            batch.append((seq, 1))
            scheduled.add(id(seq))
        budget -= len(batch)
        for seq in self.running:  # prefills under way (chunked)
            remaining = seq.num_tokens - seq.num_cached
            if id(seq) in scheduled or remaining < 1 or budget < 1:
                continue
            chunkable = cfg.enable_chunked_prefill or bool(seq.output_ids)  # recomputes may always chunk
            n = min(remaining, budget) if chunkable else (remaining if remaining <= budget else 0)
            n = _clip_to_snapshot(seq, n)
            if n > 0:
                batch.append((seq, n))
                budget -= n
        while self.waiting and self.free_slots and budget > 0:
            seq = self.waiting[0]
            remaining = seq.num_tokens - seq.num_cached
            if self.reserved_tokens() + seq.num_tokens > cfg.max_cached_tokens:
                break  # its whole prompt must fit, not just the first chunk
            recompute = bool(seq.output_ids)  # preempted: may be longer than any one step now
            if remaining > budget and not (cfg.enable_chunked_prefill or recompute):
                break  # FIFO: wait for a step with room rather than let later requests pass
            if (
                remaining > budget
                and cfg.whole_prompts
                and remaining + len(decoding) <= cfg.max_num_batched_tokens
            ):
                break  # the next step takes it whole (FIFO as above)
            self.waiting.popleft()
            seq.slot = self.free_slots.pop()
            self.running.append(seq)
            if on_admit is not None:
                on_admit(seq)
                remaining = seq.num_tokens - seq.num_cached
            n = _clip_to_snapshot(seq, min(remaining, budget))
            batch.append((seq, n))
            budget -= n
        return batch

    def finish(self, seq: Sequence, release) -> None:
        if seq in self.running:
            self.running.remove(seq)
            self._release(seq, release)

    def abort(self, seq: Sequence, release) -> None:
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.finish(seq, release)


def _clip_to_snapshot(seq: Sequence, n: int) -> int:
    stop = seq.stop_at
    return min(n, stop - seq.num_cached) if seq.num_cached < stop else n


def check_fits(seq: Sequence, config: SchedulerConfig) -> None:
    """A prompt that no schedule could ever run is refused up front instead of waiting forever."""
    n = seq.num_tokens
    if n >= config.max_cached_tokens:
        raise ValueError(
            f"prompt of {n} tokens does not fit the cache budget ({config.max_cached_tokens} tokens)"
        )
    if not config.enable_chunked_prefill and n > config.max_num_batched_tokens:
        raise ValueError(
            f"prompt of {n} tokens exceeds --max-num-batched-tokens {config.max_num_batched_tokens} "
            "and chunked prefill is off"
        )
