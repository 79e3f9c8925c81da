"""The serving engine core: the scheduler's batches through the model runner, sampling, and bookkeeping.

``EngineCore`` is synchronous and single-threaded (one ``step()`` at a time). It owns what it is given -- the
model runner, the sampler (``TokenSampler``), the speculator, a prefix cache -- and builds its scheduler; it
knows no front. ``front.async_engine.AsyncEngine`` runs it on a background thread, ``front.process`` in a
process of its own; offline ``LLM.generate`` steps it directly. ``FP4MOE_STEP_TRACE`` records its steps
(``step_trace.StepTrace``).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from fp4moe.engine.device.transfer import Readback, to_device
from fp4moe.engine.loop.prefix_cache import PrefixCache
from fp4moe.engine.loop.scheduler import QueueFullError, Scheduler, SchedulerConfig
from fp4moe.engine.loop.step_trace import StepTrace
from fp4moe.engine.request.sampler import SampleResult, sample_tokens
from fp4moe.engine.request.sequence import FinishReason, Sequence
from fp4moe.engine.request.token_sampler import TokenSampler


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
    async_steps: int = 0  # decode steps launched without waiting for their tokens (async scheduling)
    # latency samples, drained by the metrics collector (bounded: unscraped samples are dropped)
    ttft: deque = field(default_factory=lambda: deque(maxlen=100_000))
    itl: deque = field(default_factory=lambda: deque(maxlen=100_000))
    e2e: deque = field(default_factory=lambda: deque(maxlen=100_000))


class EngineCore:
    def __init__(
        self,
        runner,
        sampler: TokenSampler,
        config: SchedulerConfig,
        speculator=None,
        prefix_cache: PrefixCache | None = None,
        async_scheduling: bool = True,
    ):
        """``runner``: a ``ModelRunner`` or ``CudaModelRunner``; ``sampler``: samples and appends the tokens
        (its ``max_model_len`` is the context's end); ``speculator``: an ``MTPSpeculator`` over the same
        runner and sampler, or None."""
        self.runner, self.sampler, self.speculator = runner, sampler, speculator
        self.max_model_len = sampler.max_model_len
        self.async_scheduling = async_scheduling  # decode steps launched ahead of their read-back (``step``)
        self._inflight: _InFlight | None = None
        self.last_rows = (
            0,
            0,
            0,
        )  # the last step's decodes, prefill tokens and prefilling sequences (traced)
        self.prefix_cache = prefix_cache
        self.scheduler = Scheduler(config)
        self.kv, self.states = runner.new_caches()
        self.stats = EngineStats()
        self._ids = itertools.count()
        path = os.environ.get("FP4MOE_STEP_TRACE")
        self.trace = StepTrace.of(path) if path else None

    def _release(self, slot: int) -> None:
        self.kv.free(slot)
        self.states.free(slot)

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

    def snapshot(self) -> dict:
        """What ``/metrics`` shows: counters, queue lengths, cache use, speculation's counts, compiles since
        the warm-up, and the latency samples since the last snapshot (drained)."""
        from fp4moe.kernels import compiles

        stats, sched, pc = self.stats, self.scheduler, self.prefix_cache
        spec = self.speculator
        samples = {}
        for name in ("ttft", "itl", "e2e"):
            queue = getattr(stats, name)
            samples[name] = list(queue)
            queue.clear()
        return dict(
            running=len(sched.running),
            waiting=len(sched.waiting),
            kv_usage=sched.cached_tokens() / sched.config.max_cached_tokens,
            preemptions=sched.num_preemptions,
            prompt=stats.prompt_tokens,
            generation=stats.generation_tokens,
            success=stats.finished_requests,
            aborted=stats.aborted_requests,
            steps=stats.steps,
            async_steps=stats.async_steps,
            prefix_queries=pc.queries if pc else 0,
            prefix_hits=pc.hits if pc else 0,
            spec=None if spec is None else spec.stats.counts(),
            compiles=dict(compiles.after_mark()),
            **samples,
        )

    def stop(self, seq: Sequence) -> None:
        """End a sequence that a stop string ended in the API front (which detokenizes when the engine runs
        in its own process): released, and counted as finished, not aborted."""
        if seq.finished or seq not in self.scheduler.running:
            return
        seq.finish_reason = FinishReason.STOP
        self.scheduler.finish(seq, self._release)
        self.stats.finished_requests += 1
        self.stats.e2e.append(time.monotonic() - seq.arrival)

    def _on_admit(self, seq: Sequence) -> None:
        """Restore the longest cached prefix of a fresh prompt; mark where its own snapshot is taken."""
        pc = self.prefix_cache
        if pc is None or seq.image_embeds is not None or seq.num_cached or seq.output_ids:
            return
        if seq.params.prompt_logprobs is not None:  # every prompt position must run to be scored (vLLM: same)
            return
        snap = pc.lookup(seq.prompt_ids)
        if snap is not None:
            pc.restore(snap, self.kv, self.states, seq.slot)
            seq.num_cached = snap.length
        boundary = pc.boundary(len(seq.prompt_ids))
        if boundary > seq.num_cached and not pc.contains(seq.prompt_ids, boundary) and pc.fits(boundary):
            seq.stop_at = boundary

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None

    def discard_inflight(self) -> None:
        """Forget the step in flight (its sequences were aborted; the GPU finishes it on its own)."""
        self._inflight = None

    def step_or_fail(self) -> list[StepOutput]:
        """``step``; a step that raises fails the sequences that were running (each gets an error output, its
        caches freed), not the engine: one bad step must not take a server down."""
        try:
            return self.step()
        except Exception as e:
            logging.getLogger("fp4moe").exception("engine step failed")
            failed = list(self.scheduler.running)
            for seq in failed:
                self.abort(seq)
            self.discard_inflight()
            return [StepOutput(seq, -1, "", True, error=f"{type(e).__name__}: {e}") for seq in failed]

    def step(self) -> list[StepOutput]:
        """``_step``, and with ``FP4MOE_STEP_TRACE`` set its line in the step trace."""
        if self.trace is None:
            return self._step()
        start = time.monotonic()
        outputs = self._step()
        self.trace.write(start, self)
        return outputs

    def _step(self) -> list[StepOutput]:
        """One engine step: schedule, run, sample, hand out the new tokens. With async scheduling a
        decode-only step is launched and its tokens are read back by the next ``step``, after that one has
        launched its own step on the GPU: the host's per-step work (detokenizing, stop checks, the
        scheduler, the next step's inputs) runs while the GPU computes, as in vLLM V1's async scheduling.
        A decode-only step of speculating sequences is a fused round, run ahead the same way (its inputs
        left on the GPU by the round before)."""
        prev, self._inflight = self._inflight, None
        if prev is not None and prev.round:
            ahead = self._rounds_ahead(prev)
            if ahead:
                self.stats.steps += 1
                self._inflight = self._launch_round(ahead, chained=True)
            self.last_rows = (len(ahead), 0, 0)
            return self._complete_round(prev)
        if prev is not None:
            ahead = self._ahead(prev)
            if ahead:
                self.stats.steps += 1
                self._inflight = self._launch(ahead, prev)
            self.last_rows = (len(ahead), 0, 0)
            return self._complete(prev)
        batch = self.scheduler.schedule(self._release, self._on_admit)
        if self.trace is not None:  # counted before the step moves the sequences on
            decodes = sum(1 for s, n in batch if n == 1 and s.num_cached >= len(s.prompt_ids))
            self.last_rows = (decodes, sum(n for _, n in batch) - decodes, len(batch) - decodes)
        outputs = [
            StepOutput(seq, seq.output_ids[-1] if seq.output_ids else -1, "", True, new_tokens=0)
            for seq in self.scheduler.cache_full
        ]  # ended: the cache cannot hold them
        self.scheduler.cache_full.clear()
        if not batch:
            return outputs
        self.stats.steps += 1
        if self._overlappable(batch):
            self._inflight = self._launch([seq for seq, _ in batch], None)
            return outputs
        if self._rounds_overlappable(batch):
            self._inflight = self._launch_round([seq for seq, _ in batch], chained=False)
            return outputs
        spec = self.speculator
        if spec is None:
            results = self.runner.run(batch, self.kv, self.states)
            progressed = [seq for seq, _ in results]
        else:
            results = []
            progressed = spec.run_batch(batch, self.kv, self.states, self.max_model_len)
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
        self.sampler.sample_all(results)
        return outputs + self._emit(progressed)

    # ---- async scheduling ---------------------------------------------------------------------------

    def _overlappable(self, batch: list[tuple[Sequence, int]]) -> bool:
        """Whether a scheduled batch may run ahead of its tokens' read-back: decodes only, through the
        runner's fused step, sampled on the device from what is known before the tokens come back (no
        penalties, which read the history; no logprobs, read back with the token)."""
        return (
            self.async_scheduling
            and self.runner.fusable_decode(batch, self.kv)
            and all(not s.params.penalized and s.params.logprobs is None and self._plain(s) for s, _ in batch)
        )

    def _plain(self, seq: Sequence) -> bool:
        """Whether the sequence's next decode step is a plain one: no speculation, or speculation backed off
        (its drafts did not pay lately) or never drafting (``MTPSpeculator.plain_only``) -- a rejected draft
        head then costs nothing beyond its probes."""
        spec = self.speculator
        if spec is None:
            return True
        return seq.hidden_tail is not None and (seq.spec_backoff > 0 or spec.plain_only(seq, self.kv))

    def _ahead(self, prev: _InFlight) -> list[Sequence]:
        """The sequences of the step in flight that decode again before its tokens reach the host: every
        running sequence must be one of them and nothing may wait for a free slot (such a sequence gets
        the synchronous schedule; while every slot is taken the waiting ones wait for a sequence to end
        either way), and those that the in-flight token ends by length are left out. A
        sequence the in-flight token ends otherwise (EOS, a stop string) runs one wasted row."""
        sched = self.scheduler
        if not self.async_scheduling or (sched.waiting and sched.free_slots):
            return []  # an arrival (or a preempted sequence) that a slot can take: the synchronous schedule
        running = {id(s) for s in sched.running}
        if not running <= {id(s) for s in prev.seqs}:
            return []
        limit = self.max_model_len
        ahead = [
            s
            for s in prev.seqs
            if id(s) in running
            and len(s.output_ids) + 1 < s.params.max_tokens
            and s.num_tokens + 1 < limit
            and s.num_cached == s.num_tokens  # its one token in flight, cached by the step that follows
        ]
        if sched.reserved_tokens() + 2 * len(ahead) > sched.config.max_cached_tokens:
            return []  # the cache may not hold them: the synchronous schedule preempts
        if not all(self._plain(s) for s in ahead):
            return []  # a speculating sequence probes again: a synchronous round
        return ahead

    def _speculating(self, seq: Sequence) -> bool:
        """Whether the sequence's next decode step is a fused speculative round that can run ahead of the
        host: it holds its drafts (it had a fused round), is not backed off, and the round it may launch
        while one is in flight fits in its context (up to 3k + 1 positions past its pending token)."""
        spec = self.speculator
        limit = self.max_model_len
        return (
            spec.fused is not None
            and seq.drafts is not None
            and seq.spec_backoff == 0
            and not spec.plain_only(seq, self.kv)
            and spec._fusable(seq, self.kv, limit)
            and seq.num_tokens + 3 * spec.k + 1 < limit
        )

    def _rounds_overlappable(self, batch: list[tuple[Sequence, int]]) -> bool:
        """Whether a scheduled batch is one fused speculative round that may run ahead of its tokens'
        read-back (``_overlappable``'s rule for speculation): decodes only, every sequence speculating, no
        more of them than speculation takes at once."""
        spec = self.speculator
        if not self.async_scheduling or spec is None or spec.fused is None:
            return False
        if spec.disable_by_batch_size and len(batch) > spec.disable_by_batch_size:
            return False
        return self.runner.fusable_decode(batch, self.kv) and all(self._speculating(s) for s, _ in batch)

    def _rounds_ahead(self, prev: _InFlight) -> list[Sequence]:
        """The sequences of the round in flight, when the next round of the same sequences (all of them, in
        the same order: the round's graph leaves the next one's inputs in place) may launch before its
        tokens reach the host; [] where the chain breaks (an arrival a slot can take, a sequence ended or
        backed off, one the round in flight might end by length or back off, a cache that may not hold
        them)."""
        sched, spec = self.scheduler, self.speculator
        k = spec.k
        if not self.async_scheduling or (sched.waiting and sched.free_slots):
            return []
        running = {id(s) for s in sched.running}
        if running != {id(s) for s in prev.seqs} or any(s.finished for s in prev.seqs):
            return []
        for s in prev.seqs:
            if (
                not self._speculating(s)
                or len(s.output_ids) + k + 1 >= s.params.max_tokens
                or spec.policy.may_back_off(s)
            ):
                return []
        if sched.reserved_tokens() + (3 * k + 1) * len(prev.seqs) > sched.config.max_cached_tokens:
            return []
        return prev.seqs

    def _launch_round(self, seqs: list[Sequence], chained: bool) -> _InFlight:
        """Launch a fused speculative round for ``seqs``; its tokens are read back by the next step."""
        handle = self.speculator.launch_round(seqs, chained)
        self.stats.async_steps += 1
        return _InFlight(seqs, None, handle, round=True)

    def _complete_round(self, prev: _InFlight) -> list[StepOutput]:
        """The round in flight's tokens appended (``MTPSpeculator.finish_round``); sequences that ended or
        were aborted meanwhile get nothing."""
        running = {id(s) for s in self.scheduler.running}
        live = [id(s) in running and not s.finished for s in prev.seqs]
        ps = [s.num_tokens - 1 for s in prev.seqs]  # every earlier round is in: the pending positions
        counts = self.speculator.finish_round(prev.seqs, ps, prev.readback, live)
        progressed = []
        for seq, ok, n in zip(prev.seqs, live, counts, strict=True):
            if ok:
                seq.new_tokens = n
                progressed.append(seq)
        return self._emit(progressed)

    def _launch(self, seqs: list[Sequence], prev: _InFlight | None) -> _InFlight:
        """Run the fused decode step for ``seqs`` and sample on the device; the ids start their way to the
        host. ``prev``: the step in flight, whose (device) tokens are this step's inputs."""
        tokens = None
        if prev is not None:
            row = {id(s): i for i, s in enumerate(prev.seqs)}
            index = [row[id(s)] for s in seqs]
            tokens = (
                prev.tokens[: len(seqs)]
                if index == list(range(len(seqs)))
                else prev.tokens.index_select(0, to_device(index, torch.long, prev.tokens.device))
            )
        spec = self.speculator
        timed = spec.policy.cost.timed("plain", len(seqs)) if spec is not None else contextlib.nullcontext()
        with timed:  # plain steps' time by batch size: whether speculation's rounds pay against them
            logits, hidden = self.runner.decode_step(
                seqs, keep_hidden=spec is not None, host=False, tokens=tokens
            )
        if spec is not None:  # the MTP head's inputs kept for its next probe, a plain step off the backoff
            spec.keep_plain_step(seqs, hidden)
            # a backoff counts the steps that could have drafted, as decode_round's does: not those of a
            # never-drafting sequence, nor those of a batch over the speculation limit
            limit = spec.disable_by_batch_size
            if not limit or len(seqs) <= limit:
                for s in seqs:
                    if s.spec_backoff > 0 and not spec.plain_only(s, self.kv):
                        s.spec_backoff -= 1
        sampled = sample_tokens(logits, [s.sample_row() for s in seqs])
        self.stats.async_steps += 1
        return _InFlight(seqs, sampled, Readback(sampled))

    def _complete(self, prev: _InFlight) -> list[StepOutput]:
        """The in-flight step's tokens, now on the host, appended as a synchronous step's would be; rows of
        sequences that ended (or were aborted) meanwhile are dropped."""
        running = {id(s) for s in self.scheduler.running}
        progressed = []
        for seq, token in zip(prev.seqs, prev.readback.tolist(), strict=True):
            if id(seq) not in running or seq.finished:
                continue
            self.sampler.accept(seq, SampleResult(token))
            seq.new_tokens = 1
            progressed.append(seq)
        return self._emit(progressed)

    def _emit(self, progressed: list[Sequence]) -> list[StepOutput]:
        """Step outputs of the sequences that got tokens (timings, finished sequences released)."""
        outputs = []
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


@dataclass
class _InFlight:
    """A decode step launched on the GPU whose tokens are not on the host yet (async scheduling)."""

    seqs: list[Sequence]
    tokens: torch.Tensor | None  # [b] the sampled ids on the device: the next step's inputs (plain steps)
    readback: Readback | tuple  # the same ids on their way to the host (a round: ``FusedSpecRound.finish``'s)
    round: bool = False  # a fused speculative round (``MTPSpeculator.launch_round``)
