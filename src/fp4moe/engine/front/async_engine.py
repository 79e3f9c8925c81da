"""``AsyncEngine``: ``EngineCore`` on a background thread of the server's process; ``submit`` returns an asyncio
queue of a request's ``StepOutput``s, filled from the engine thread through the event loop (``deliver``)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque

from fp4moe.engine.loop.core import EngineCore, EngineStoppedError, StepOutput
from fp4moe.engine.loop.scheduler import QueueFullError
from fp4moe.engine.request.sampler import SamplingParams
from fp4moe.engine.request.sequence import Sequence


def deliver(items: list[tuple[asyncio.Queue, StepOutput]]) -> None:
    for queue, out in items:
        queue.put_nowait(out)


class AsyncEngine:
    """EngineCore on a background thread; ``submit`` returns an asyncio queue of StepOutputs (then None)."""

    def __init__(self, core: EngineCore, prompts, encode_images=None, warm_thread=None):
        """``core`` runs on the thread; beside it, from the front that built it (``LLM``): ``prompts``
        (``Prompts``: the model's request side), ``encode_images`` (the vision tower on a sequence's images)
        and ``warm_thread`` (what the warm-up fills per thread, run first on the engine thread)."""
        self.core, self.prompts = core, prompts
        self._encode_images, self._warm_thread = encode_images, warm_thread
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._queues: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue, Sequence]] = {}
        self._inbox: deque = deque()  # ("add" | "abort", sequences), appended by the event loop
        self._registry = threading.Lock()  # submit's registration vs a dying thread's _fail_all
        self._failed = False
        self.failure: str | None = None  # why the engine thread died, when it did
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="fp4moe-engine", daemon=True)
        self._thread.start()

    @property
    def max_waiting(self) -> int:
        return self.core.scheduler.config.max_waiting

    def make_sequences(self, prompt, params: SamplingParams) -> list[Sequence]:
        """Encode a prompt (text, ids or a multimodal dict) into ``params.n`` sequences (may raise; the images
        through the vision tower)."""
        _, seqs = self.prompts.make_sequences([prompt], [params], self._encode_images)
        now = time.monotonic()
        for seq in seqs:
            seq.arrival, seq.last_token_time, seq.slot = now, None, -1
        return seqs

    async def snapshot(self) -> dict:
        """``EngineCore.snapshot``, between two steps."""
        with self._lock:
            return self.core.snapshot()

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
            if self._warm_thread is not None:  # the warm-up ran on the thread that built the engine
                self._warm_thread()
            self._run()
        except BaseException as e:  # the thread dies: no request may wait for it forever
            logging.getLogger("fp4moe").exception("the engine thread stopped")
            self._fail_all(f"the engine stopped ({type(e).__name__}: {e})")
            if not self._stop:
                self.failure = f"{type(e).__name__}: {e}"  # the server's watchdog exits on it
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
                busy = self.core.has_work()
                outputs = self.core.step_or_fail() if busy else []
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
                loop.call_soon_threadsafe(deliver, items)
            if not busy:
                self._wake.wait(0.05)
                self._wake.clear()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop and not self._failed

    def shutdown(self, timeout: float = 30.0) -> None:
        """Finish in-flight requests (up to ``timeout`` seconds), then stop the thread."""
        deadline = time.monotonic() + timeout
        while self._thread.is_alive() and self.core.has_work() and time.monotonic() < deadline:
            time.sleep(0.02)
        with self._lock:
            for seq in list(self.core.scheduler.running) + list(self.core.scheduler.waiting):
                self.core.abort(seq)
        self._stop = True
        self._wake.set()
        self._thread.join(5)
