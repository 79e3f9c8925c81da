"""The serving engine core: the scheduler's batches through the model runner, sampling, and bookkeeping.

``EngineCore`` is synchronous and single-threaded (one ``step()`` at a time); ``AsyncEngine`` runs it on a
background thread and hands each request's outputs to an asyncio queue, so a web server can await them.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fp4moe.engine.prefix_cache import PrefixCache
from fp4moe.engine.sampler import SamplingParams
from fp4moe.engine.scheduler import QueueFullError, Scheduler, SchedulerConfig
from fp4moe.engine.sequence import Sequence

if TYPE_CHECKING:
    from fp4moe.engine.llm import LLM


@dataclass
class StepOutput:
    seq: Sequence
    token_id: int
    delta: str
    finished: bool
    logprob: object = None  # the SampleResult of this token when logprobs were asked for
    error: str | None = None  # the engine failed this request (the server answers with an error)
    new_tokens: int = 1  # tokens this step appended (0: ended without one, e.g. the cache cannot hold it)


class EngineStoppedError(RuntimeError):
    """The engine thread is not running (it failed, or the server is shutting down)."""


@dataclass
class EngineStats:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished_requests: int = 0
    aborted_requests: int = 0
    steps: int = 0
    # latency samples, drained by the metrics collector (bounded: unscraped samples are dropped)
    ttft: deque = field(default_factory=lambda: deque(maxlen=100_000))
    itl: deque = field(default_factory=lambda: deque(maxlen=100_000))
    e2e: deque = field(default_factory=lambda: deque(maxlen=100_000))


class EngineCore:
    def __init__(self, llm: LLM, config: SchedulerConfig, prefix_cache: PrefixCache | None = None):
        self.llm = llm
        self.prefix_cache = prefix_cache
        self.scheduler = Scheduler(config)
        self.kv, self.states = llm.runner.new_caches()
        self.stats = EngineStats()
        self._ids = itertools.count()

    def _release(self, slot: int) -> None:
        self.kv.free(slot)
        self.states.free(slot)

    def make_sequences(self, prompt, params: SamplingParams) -> list[Sequence]:
        """Encode a prompt (text, ids or a multimodal dict) into ``params.n`` sequences (may raise)."""
        _, seqs = self.llm._make_sequences([prompt], [params])
        now = time.monotonic()
        for seq in seqs:
            seq.arrival, seq.last_token_time, seq.slot = now, None, -1
        return seqs

    def add(self, seqs: list[Sequence]) -> None:
        if len(self.scheduler.waiting) + len(seqs) > self.scheduler.config.max_waiting:
            raise QueueFullError(f"the waiting queue is full ({self.scheduler.config.max_waiting} requests)")
        for seq in seqs:
            self.scheduler.check_fits(seq)  # all or none
        for seq in seqs:
            self.scheduler.add(seq)
            self.stats.prompt_tokens += len(seq.prompt_ids)

    def abort(self, seq: Sequence) -> None:
        if not seq.finished:
            self.stats.aborted_requests += 1
        self.scheduler.abort(seq, self._release)

    def _on_admit(self, seq: Sequence) -> None:
        """Restore the longest cached prefix of a fresh prompt; mark where its own snapshot is taken."""
        pc = self.prefix_cache
        if pc is None or seq.image_embeds is not None or seq.num_cached or seq.output_ids:
            return
        snap = pc.lookup(seq.prompt_ids)
        if snap is not None:
            pc.restore(snap, self.kv, self.states, seq.slot)
            seq.num_cached = snap.length
        boundary = pc.boundary(len(seq.prompt_ids))
        if boundary > seq.num_cached and not pc.contains(seq.prompt_ids, boundary):
            seq.stop_at = boundary

    def _spec_batch(self, batch) -> list[Sequence]:
        return run_spec_batch(self, batch)

    def step(self) -> list[StepOutput]:
        batch = self.scheduler.schedule(self._release, self._on_admit)
        outputs = [
            StepOutput(seq, seq.output_ids[-1] if seq.output_ids else -1, "", True, new_tokens=0)
            for seq in self.scheduler.cache_full
        ]  # ended: the cache cannot hold them
        self.scheduler.cache_full.clear()
        if not batch:
            return outputs
        self.stats.steps += 1
        spec = self.llm.speculator
        if spec is None:
            results = self.llm.runner.run(batch, self.kv, self.states)
            progressed = [seq for seq, _ in results]
        else:
            results, progressed = [], self._spec_batch(batch)
        if self.prefix_cache is not None:
            for seq, _ in batch:
                if seq.stop_at and seq.num_cached == seq.stop_at:
                    self.prefix_cache.store(
                        seq.prompt_ids,
                        seq.stop_at,
                        self.kv,
                        self.states,
                        seq.slot,
                    )
                    seq.stop_at = 0
        self.llm.sample_all(results)
        for seq in progressed:
            now = time.monotonic()
            if seq.last_token_time is None:
                self.stats.ttft.append(now - seq.arrival)
            else:
                self.stats.itl.append(now - seq.last_token_time)
            seq.last_token_time = now
            self.stats.generation_tokens += seq.new_tokens
            lp = seq.logprobs[-1] if seq.params.logprobs is not None and seq.logprobs else None
            outputs.append(
                StepOutput(seq, seq.output_ids[-1], seq.delta, seq.finished, lp, new_tokens=seq.new_tokens)
            )
            if seq.finished:
                self.scheduler.finish(seq, self._release)
                self.stats.finished_requests += 1
                self.stats.e2e.append(now - seq.arrival)
        return outputs


def run_spec_batch(core: EngineCore, batch) -> list[Sequence]:
    """Run a scheduled batch with MTP speculative decoding: prefill chunks in one flat forward (their hidden
    states kept for the MTP head), then a draft-and-verify round for every decoding sequence."""
    spec = core.llm.speculator
    decoding = [
        s for s, n in batch if n == 1 and s.num_cached == s.num_tokens - 1 and s.hidden_tail is not None
    ]
    prefill = [(s, n) for s, n in batch if s not in decoding]
    progressed = spec.prefill(prefill, core.kv, core.states) if prefill else []
    if spec.disable_by_batch_size and len(decoding) > spec.disable_by_batch_size:
        # under load one batched plain step beats per-sequence draft-and-verify; the MTP head keeps its
        # inputs (hidden states) and catches up when the batch shrinks again
        spec.stats.disabled_steps += 1
        spec.plain_steps(decoding, core.kv, core.states)  # drafts kept for the fused round are dropped
        for seq in decoding:
            seq.new_tokens = 1
            progressed.append(seq)
        return progressed
    for seq, n in zip(
        decoding, spec.decode_round(decoding, core.kv, core.states, core.llm.max_model_len), strict=True
    ):
        seq.new_tokens = n
        progressed.append(seq)
    return progressed


def _deliver(items: list[tuple[asyncio.Queue, StepOutput]]) -> None:
    for queue, out in items:
        queue.put_nowait(out)


class AsyncEngine:
    """EngineCore on a background thread; ``submit`` returns an asyncio queue of StepOutputs (then None)."""

    def __init__(self, core: EngineCore):
        self.core = core
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._queues: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue, Sequence]] = {}
        self._inbox: deque = deque()  # ("add" | "abort", sequences), appended by the event loop
        self._registry = threading.Lock()  # submit's registration vs a dying thread's _fail_all
        self._failed = False
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="fp4moe-engine", daemon=True)
        self._thread.start()

    def submit(self, seqs: list[Sequence]) -> asyncio.Queue:
        """Queue sequences for the engine without waiting for the current step (a lock-free inbox the engine
        thread drains); raises QueueFullError / ValueError at once for requests it would refuse."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        sched = self.core.scheduler
        for seq in seqs:
            sched.check_fits(seq)
        pending = sum(len(item[1]) for item in list(self._inbox) if item[0] == "add")
        if len(sched.waiting) + pending + len(seqs) > sched.config.max_waiting:
            raise QueueFullError(f"the waiting queue is full ({sched.config.max_waiting} requests)")
        with self._registry:  # not between a dying thread's _fail_all and its end
            if not self.alive:
                raise EngineStoppedError("the engine is not running")
            for seq in seqs:
                self._queues[id(seq)] = (loop, queue, seq)
        self._inbox.append(("add", seqs))
        self._wake.set()
        return queue

    def abort(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self._queues.pop(id(seq), None)
        self._inbox.append(("abort", seqs))
        self._wake.set()

    def _drain_inbox(self) -> None:
        while self._inbox:
            kind, seqs = self._inbox.popleft()
            if kind == "add":
                try:
                    self.core.add(seqs)
                except (QueueFullError, ValueError) as e:  # raced past submit's checks
                    for seq in seqs:
                        target = self._queues.pop(id(seq), None)
                        if target is not None:
                            loop, queue, _ = target
                            loop.call_soon_threadsafe(
                                queue.put_nowait, StepOutput(seq, -1, "", True, error=str(e))
                            )
            else:
                for seq in seqs:
                    self.core.abort(seq)

    def _loop(self) -> None:
        try:
            self._run()
        except BaseException as e:  # the thread dies: no request may wait for it forever
            logging.getLogger("fp4moe").exception("the engine thread stopped")
            self._fail_all(f"the engine stopped ({type(e).__name__}: {e})")
            raise

    def _fail_all(self, error: str) -> None:
        with self._registry:
            self._failed = True
            for loop, queue, seq in list(self._queues.values()):
                loop.call_soon_threadsafe(queue.put_nowait, StepOutput(seq, -1, "", True, error=error))
            self._queues.clear()

    def _run(self) -> None:
        while not self._stop:
            with self._lock:
                self._drain_inbox()
                busy = self.core.scheduler.has_work()
                try:
                    outputs = self.core.step() if busy else []
                except Exception as e:  # one bad step must not take the server down: fail what was running
                    logging.getLogger("fp4moe").exception("engine step failed")
                    failed = list(self.core.scheduler.running)
                    for seq in failed:
                        self.core.abort(seq)
                    outputs = [
                        StepOutput(seq, -1, "", True, error=f"{type(e).__name__}: {e}") for seq in failed
                    ]
                targets = [(self._queues.get(id(o.seq)), o) for o in outputs]
                for o in outputs:
                    if o.finished:
                        self._queues.pop(id(o.seq), None)
            by_loop: dict[asyncio.AbstractEventLoop, list] = {}
            for target, out in targets:
                if target is not None:
                    loop, queue, _ = target
                    by_loop.setdefault(loop, []).append((queue, out))
            for loop, items in by_loop.items():  # one wake-up of each event loop per step, not one per token
                loop.call_soon_threadsafe(_deliver, items)
            if not busy:
                self._wake.wait(0.05)
                self._wake.clear()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop and not self._failed

    def shutdown(self, timeout: float = 30.0) -> None:
        """Finish in-flight requests (up to ``timeout`` seconds), then stop the thread."""
        deadline = time.monotonic() + timeout
        while self._thread.is_alive() and self.core.scheduler.has_work() and time.monotonic() < deadline:
            time.sleep(0.02)
        with self._lock:
            for seq in list(self.core.scheduler.running) + list(self.core.scheduler.waiting):
                self.core.abort(seq)
        self._stop = True
        self._wake.set()
        self._thread.join(5)
