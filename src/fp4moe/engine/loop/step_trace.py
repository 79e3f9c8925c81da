"""The engine's step trace (``FP4MOE_STEP_TRACE=path``): a JSON line per step, for comparing served and offline
runs step by step (``benchmarks/step_trace.py`` sums them)."""

from __future__ import annotations

import json
import time


class StepTrace:
    """One JSON line per engine step (``FP4MOE_STEP_TRACE=path``): when it started and how long the host
    spent in it (seconds; an async step returns once its successor is launched), the rows it scheduled --
    decodes, prefill tokens and the sequences they belong to -- whether it was launched ahead of its
    tokens, and the queue lengths after it. Served and offline runs of the same requests compare step by
    step (``benchmarks/step_trace.py``)."""

    _open: dict[str, StepTrace] = {}  # one per file: every ``generate`` makes an engine core

    def __init__(self, path: str):
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 -- open for the process's life, a line a step

    @classmethod
    def of(cls, path: str) -> StepTrace:
        if path not in cls._open:
            cls._open[path] = cls(path)
        return cls._open[path]

    def write(self, start: float, core) -> None:
        decodes, prefill_tokens, prefill_seqs = core.last_rows
        line = dict(
            t=round(start, 6),
            dt=round(time.monotonic() - start, 6),
            decode=decodes,
            prefill_tokens=prefill_tokens,
            prefill_seqs=prefill_seqs,
            ahead=core._inflight is not None,
            running=len(core.scheduler.running),
            waiting=len(core.scheduler.waiting),
        )
        self._file.write(json.dumps(line) + "\n")
