"""The engine loop in its own process (vLLM V1's engine core, SGLang's scheduler process).

``fp4moe serve`` on the GPU runs ``EngineCore`` in a child process, so nothing the API front does (HTTP,
tokenizing, chat templates, detokenizing, stop strings, reasoning and tool-call parsers, SSE) takes the
engine's GIL. The front encodes prompts (``Prompts``: token ids, an image's pixels) and sends whole
``Sequence`` objects; the engine sends back, once per step, each sequence's new token ids. The front
appends them to its own copy of the sequence (``Sequence.append``: detokenizing, stop checks) and aborts a
sequence in the engine when a stop string ends it there.

Messages over one duplex ``multiprocessing`` pipe, both ends ours (pickle, as ``multiprocessing`` does):

- front -> engine: ("add", [Sequence]), ("abort", [seq_id]), ("stop_strings", [seq_id]), ("snapshot", None),
  ("stop", seconds)
- engine -> front: ("ready", info), ("refused_to_start", message), ("out", [(seq_id, ids, results, finish_reason, error)]),
  ("refused", ([seq_id], error)), ("snapshot", dict), ("failed", error)

``EngineProcess`` has ``AsyncEngine``'s interface (``submit``, ``abort``, ``snapshot``, ``alive``,
``shutdown``), so the server runs on either.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import signal
import sys
import threading
import time
from dataclasses import dataclass

from fp4moe.engine.front.async_engine import deliver
from fp4moe.engine.front.config import EngineConfig
from fp4moe.engine.loop.core import EngineStoppedError, StepOutput
from fp4moe.engine.loop.scheduler import QueueFullError, SchedulerConfig, check_fits
from fp4moe.engine.request.prompts import Prompts
from fp4moe.engine.request.sampler import SampleResult, SamplingParams
from fp4moe.engine.request.sequence import FinishReason, Sequence
from fp4moe.errors import USER_ERRORS, UserError

log = logging.getLogger("fp4moe")


class EngineStartError(UserError):
    """The engine process refused its model or settings (a bad checkpoint): reported in one line."""


@dataclass
class EngineSpec:
    """What the engine process builds: the model, how it runs, and the server's engine options."""

    model: str
    config: EngineConfig
    warmup: bool = True
    max_waiting: int = 1 << 30
    prefix_cache: tuple[int, int, int] | None = None  # (block size, entries, bytes); None: off


def start_engine(spec: EngineSpec):
    """The model loaded, warmed up on the GPU, and its engine core -> (llm, core); prints the effective
    settings. The server's engine thread and the engine process both start here."""
    from fp4moe.engine.front.llm import LLM
    from fp4moe.engine.loop.prefix_cache import PrefixCache

    llm = LLM(spec.model, spec.config)
    if llm.device.type == "cuda" and spec.warmup:
        print("warming up: compiling kernels, capturing CUDA graphs ...", file=sys.stderr, flush=True)
        took = llm.warmup.run(
            llm.engine_config.max_num_batched_tokens, prefix_caching=spec.prefix_cache is not None
        )
        phases = ", ".join(f"{name} {sec:.1f} s" for name, sec in llm.warmup.phases.items())
        print(f"warm-up took {took:.1f} s ({phases})", file=sys.stderr, flush=True)
    cfg = llm.engine_config
    k = llm.speculator.k if llm.speculator is not None else 0
    async_state = "off"
    if cfg.async_scheduling and llm.device.type == "cuda":
        async_state = "on (plain steps and speculative rounds)" if k else "on"
    print(
        f"fp4moe serve: device {llm.device}, {llm.model.embed_tokens.dtype} compute, KV cache "
        f"{cfg.kv_cache_dtype} for {llm.max_cached_tokens} tokens, at most {cfg.max_num_seqs} sequences "
        f"running and {cfg.max_num_batched_tokens} tokens per step, context {llm.max_model_len}, speculative "
        f"tokens {k}, async scheduling {async_state}",
        file=sys.stderr,
        flush=True,
    )
    if llm.kv_scales_source:
        print(llm.kv_scales_source, file=sys.stderr, flush=True)
    prefix = PrefixCache(*spec.prefix_cache) if spec.prefix_cache else None
    return llm, llm.new_core(prefix_cache=prefix, max_waiting=spec.max_waiting)


# ---- the engine process ----------------------------------------------------------------------------


def _engine_main(spec: EngineSpec, conn) -> None:
    """The child: build the engine, then step it, taking messages between steps. Ends on "stop", or when
    the front's end of the pipe closes (the front died)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front shuts the engine down (a terminal's ^C)
    try:
        llm, core = start_engine(spec)
    except USER_ERRORS as e:  # a bad checkpoint or setting: the front reports it in one line
        conn.send(("refused_to_start", str(e)))
        return
    except BaseException as e:
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        raise
    llm.tokenizer = core.sampler.tokenizer = None  # the front detokenizes: the engine hands out ids
    sched = core.scheduler
    conn.send(
        (
            "ready",
            dict(
                config=llm.config,
                vocab_size=llm.model.args.vocab_size,
                max_model_len=llm.max_model_len,
                limit_images=llm.limit_images,
                load_format=llm.load_format,
                scheduler=sched.config,
            ),
        )
    )
    try:
        _EngineLoop(core, conn, llm.encode_images).run()
    except (EOFError, BrokenPipeError):  # the front is gone
        return
    except BaseException as e:  # tell the front why, then die with the traceback on stderr
        with contextlib.suppress(OSError, ValueError):
            conn.send(("failed", f"{type(e).__name__}: {e}"))
        raise


class _EngineLoop:
    def __init__(self, core, conn, encode_images):
        self.core, self.conn, self.encode_images = core, conn, encode_images
        self.seqs: dict[int, Sequence] = {}  # seq_id -> the engine's sequence
        self.deadline: float | None = None  # set by "stop": finish what runs until then

    def run(self) -> None:
        core = self.core
        while True:
            busy = core.has_work()
            if not busy and self.deadline is None:
                self.conn.poll(0.05)  # idle: wait for a message
            while self.conn.poll(0):
                self._handle(*self.conn.recv())
            if self.deadline is not None and (not core.has_work() or time.monotonic() > self.deadline):
                for seq in list(core.scheduler.running) + list(core.scheduler.waiting):
                    core.abort(seq)
                self.conn.send(("stopped", None))
                return
            if core.has_work():
                self._step()

    def _handle(self, kind: str, payload) -> None:
        core = self.core
        if kind == "add":
            encoded: dict[int, object] = {}  # n > 1 of one prompt share one pixel tensor (pickle keeps it)
            try:
                for seq in payload:
                    if seq.pixel_values is not None:
                        key = id(seq.pixel_values)
                        if key not in encoded:
                            self.encode_images(seq)
                            encoded[key] = seq.image_embeds
                        seq.image_embeds, seq.pixel_values, seq.image_grid = encoded[key], None, None
                core.add(payload)
            except Exception as e:  # raced past the front's checks (a full queue), or images that fail
                self.conn.send(("refused", ([s.seq_id for s in payload], f"{type(e).__name__}: {e}")))
                return
            for seq in payload:
                self.seqs[seq.seq_id] = seq
        elif kind in ("abort", "stop_strings"):
            for seq_id in payload:
                seq = self.seqs.pop(seq_id, None)
                if seq is not None:
                    core.abort(seq) if kind == "abort" else core.stop(seq)
        elif kind == "snapshot":
            self.conn.send(("snapshot", core.snapshot()))
        elif kind == "stop":
            self.deadline = time.monotonic() + payload

    def _step(self) -> None:
        outputs = self.core.step_or_fail()
        if not outputs:
            return
        rows = []
        for out in outputs:
            seq, n = out.seq, out.new_tokens
            ids = seq.output_ids[len(seq.output_ids) - n :] if n else []
            results = seq.logprobs[len(seq.logprobs) - n :] if n and seq.params.logprobs is not None else None
            reason = seq.finish_reason.value if seq.finish_reason is not None else None
            # prompt logprobs go with the sequence's first token (the prefill is then complete)
            prompt = seq.prompt_logprobs if seq.prompt_logprobs and len(seq.output_ids) == n else None
            rows.append((seq.seq_id, ids, results, reason if out.finished else None, out.error, prompt))
            if out.finished:
                self.seqs.pop(seq.seq_id, None)
        self.conn.send(("out", rows))


# ---- the front's handle ----------------------------------------------------------------------------


class EngineProcess:
    """The engine process, seen from the API front: ``AsyncEngine``'s interface over a pipe."""

    def __init__(self, spec: EngineSpec):
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: CUDA is the child's alone
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(
            target=_engine_main, args=(spec, child), name="fp4moe-engine", daemon=True
        )
        self._process.start()
        child.close()
        try:
            kind, info = self._conn.recv()  # loading and warm-up: minutes for a full-size model
        except EOFError:
            kind, info = "failed", f"the engine process exited (code {self._process.exitcode})"
        if kind == "refused_to_start":
            self._process.join(5)
            raise EngineStartError(info)
        if kind != "ready":
            self._process.join(5)
            raise RuntimeError(f"the engine process did not start: {info}")
        self.prompts = Prompts(
            spec.model,
            info["config"],
            info["vocab_size"],
            info["max_model_len"],
            info["limit_images"],
            info["load_format"],
        )
        self.scheduler_config: SchedulerConfig = info["scheduler"]
        self._send_lock = threading.Lock()
        self._queues: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue, Sequence]] = {}
        self._registry = threading.Lock()
        self._unstarted: set[int] = set()  # submitted, no token yet: an upper bound on the engine's waiting
        self._snapshots: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._failed = False
        self.failure: str | None = None  # why the engine died, when it did outside a shutdown
        self._stopping = False  # shutdown began: the engine's end is expected
        self._reader = threading.Thread(target=self._read, name="fp4moe-engine-reader", daemon=True)
        self._reader.start()

    @property
    def max_waiting(self) -> int:
        return self.scheduler_config.max_waiting

    @property
    def pid(self) -> int:
        return self._process.pid

    def make_sequences(self, prompt, params: SamplingParams) -> list[Sequence]:
        """Encode a prompt into ``params.n`` sequences (here, in the front; may raise)."""
        _, seqs = self.prompts.make_sequences([prompt], [params])
        now = time.monotonic()
        for seq in seqs:
            seq.arrival, seq.last_token_time = now, None
        return seqs

    def _send(self, kind: str, payload) -> None:
        with self._send_lock:
            self._conn.send((kind, payload))

    def submit(self, seqs: list[Sequence]) -> asyncio.Queue:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        for seq in seqs:
            check_fits(seq, self.scheduler_config)
        with self._registry:
            if not self.alive:
                raise EngineStoppedError("the engine is not running")
            if len(self._unstarted) + len(seqs) > self.max_waiting:
                raise QueueFullError(f"the waiting queue is full ({self.max_waiting} requests)")
            for seq in seqs:
                self._queues[seq.seq_id] = (loop, queue, seq)
                self._unstarted.add(seq.seq_id)
        try:
            self._send("add", seqs)
        except (OSError, ValueError) as e:
            self._forget([s.seq_id for s in seqs])
            raise EngineStoppedError(f"the engine is not running ({e})") from None
        return queue

    def _forget(self, ids: list[int]) -> None:
        with self._registry:
            for seq_id in ids:
                self._queues.pop(seq_id, None)
                self._unstarted.discard(seq_id)

    def abort(self, seqs: list[Sequence]) -> None:
        ids = [s.seq_id for s in seqs]
        self._forget(ids)
        with contextlib.suppress(OSError, ValueError):  # the engine is gone: nothing runs there
            self._send("abort", ids)

    async def snapshot(self) -> dict:
        """The engine's counters and the latency samples since the last snapshot (``EngineCore.snapshot``)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._registry:
            if not self.alive:
                raise EngineStoppedError("the engine is not running")
            self._snapshots.append((loop, future))
        self._send("snapshot", None)
        return await future

    # -- the reader thread: the engine's messages, turned into each request's StepOutputs ---------------

    def _read(self) -> None:
        try:
            while True:
                kind, payload = self._conn.recv()
                if kind == "out":
                    self._outputs(payload)
                elif kind == "refused":
                    ids, error = payload
                    self._fail(ids, error)
                elif kind == "snapshot":
                    with self._registry:
                        loop, future = self._snapshots.pop(0)
                    loop.call_soon_threadsafe(_resolve, future, payload)
                elif kind == "failed":
                    raise RuntimeError(payload)
                elif kind == "stopped":
                    return
        except BaseException as e:  # the engine died: no request may wait for it forever
            reason = self._death_reason(e)
            with self._registry:
                self._failed = True
                ids = list(self._queues)
                snapshots, self._snapshots = self._snapshots, []
            self._fail(ids, f"the engine stopped ({reason})")
            for loop, future in snapshots:
                loop.call_soon_threadsafe(_fail_future, future)
            if not self._stopping:
                log.error("the engine process stopped: %s", reason)
                self.failure = reason  # the server's watchdog exits on it (``server.supervision``)

    def _death_reason(self, e: BaseException) -> str:
        """Why the engine ended: its own message, else how its process exited (a signal, an exit code)."""
        if isinstance(e, RuntimeError) and e.args:
            return str(e)  # the engine's "failed" message
        self._process.join(2)
        code = self._process.exitcode
        if code is not None and code < 0:
            with contextlib.suppress(ValueError):
                return f"the engine process was killed by {signal.Signals(-code).name}"
        if code is not None:
            return f"the engine process exited with code {code}"
        return f"the pipe to the engine process broke ({type(e).__name__}: {e})"

    def _fail(self, ids: list[int], error: str) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        with self._registry:
            for seq_id in ids:
                target = self._queues.pop(seq_id, None)
                self._unstarted.discard(seq_id)
                if target is not None:
                    loop, queue, seq = target
                    by_loop.setdefault(loop, []).append((queue, StepOutput(seq, -1, "", True, error=error)))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(deliver, items)

    def _outputs(self, rows: list) -> None:
        """Append each sequence's new ids to the front's copy (detokenize, stop strings) and hand the step's
        outputs to each event loop at once; a sequence a stop string ended here is aborted in the engine."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        stopped = []
        tokenizer = self.prompts.tokenizer
        for seq_id, ids, results, reason, error, prompt_logprobs in rows:
            with self._registry:
                target = self._queues.get(seq_id)
                self._unstarted.discard(seq_id)
            if target is None:
                continue  # aborted meanwhile
            loop, queue, seq = target
            if error is not None:
                out = StepOutput(seq, -1, "", True, error=error)
            else:
                if prompt_logprobs is not None:
                    seq.prompt_logprobs = prompt_logprobs
                before = len(seq.output_ids)
                delta = seq.extend(results or [SampleResult(token) for token in ids], tokenizer)
                n = len(seq.output_ids) - before
                if (
                    reason is not None and not seq.finished
                ):  # ended by the engine alone (context or cache full)
                    seq.finish_reason = FinishReason(reason)
                    delta += seq.text[seq.emitted :]
                    seq.emitted = len(seq.text)
                if seq.finished and reason is None:
                    stopped.append(seq_id)  # a stop string: the engine would go on
                lp = seq.logprobs[-1] if seq.params.logprobs is not None and seq.logprobs else None
                token = seq.output_ids[-1] if seq.output_ids else -1
                out = StepOutput(seq, token, delta, seq.finished, lp, new_tokens=n)
            if out.finished:
                with self._registry:
                    self._queues.pop(seq_id, None)
            by_loop.setdefault(loop, []).append((queue, out))
        if stopped:
            with contextlib.suppress(OSError, ValueError):
                self._send("stop_strings", stopped)
        for loop, items in by_loop.items():  # one wake-up of each event loop per step
            loop.call_soon_threadsafe(deliver, items)

    @property
    def alive(self) -> bool:
        return self._process.is_alive() and not self._failed and not self._stopping

    def shutdown(self, timeout: float = 30.0) -> None:
        """Let the engine finish what runs (up to ``timeout`` seconds), then stop it."""
        self._stopping = True
        if self._process.is_alive():
            with contextlib.suppress(OSError, ValueError):
                self._send("stop", timeout)
        self._process.join(timeout + 10)
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(5)
        self._reader.join(5)
        self._conn.close()


def _resolve(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)


def _fail_future(future: asyncio.Future) -> None:
    if not future.done():
        future.set_exception(EngineStoppedError("the engine is not running"))
