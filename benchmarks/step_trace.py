"""Summaries of the engine's step trace (``FP4MOE_STEP_TRACE=path``: one JSON line per engine step).

    FP4MOE_STEP_TRACE=/tmp/steps.jsonl fp4moe serve ...      # or LLM.generate in the same environment
    python benchmarks/step_trace.py /tmp/steps.jsonl [--from T0 --to T1]

Within a window of time (``time.monotonic()`` seconds: the same clock in every process of the machine) it
counts the steps by kind -- prefill only, mixed (prefill chunks beside decodes), decode only -- with the
host time each kind took, the prefill tokens and sequences per prefilling step, the time the engine had
nothing to run (wall minus the steps), and when the last prefill ended (from the window's start). A served
run and the offline run of the same requests, side by side, show where serving loses time:
``benchmarks/serve.py --step-trace`` does that for every concurrency.
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path


def read(path: Path, start: float = float("-inf"), end: float = float("inf")) -> list[dict]:
    """The trace's steps that started within [start, end)."""
    path = Path(path)  # the traces kept in benchmarks/results/ are gzipped
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    steps = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [s for s in steps if start <= s["t"] < end]


def summary(steps: list[dict], start: float | None = None, end: float | None = None) -> dict:
    """Counts and host seconds by kind of step; ``start``/``end`` default to the first step's start and the
    last step's end."""
    if not steps:
        return {"steps": 0}
    start = steps[0]["t"] if start is None else start
    end = steps[-1]["t"] + steps[-1]["dt"] if end is None else end
    kinds = {"prefill": [], "mixed": [], "decode": [], "empty": []}
    for s in steps:
        kind = (
            ("mixed" if s["decode"] else "prefill")
            if s["prefill_tokens"]
            else ("decode" if s["decode"] else "empty")
        )
        kinds[kind].append(s)
    prefilling = kinds["prefill"] + kinds["mixed"]
    busy = sum(s["dt"] for s in steps)
    last_prefill = max((s["t"] + s["dt"] for s in prefilling), default=start)
    out = {
        "steps": len(steps),
        "wall_s": end - start,
        "busy_s": busy,
        "idle_s": end - start - busy,
        "first_step_after_s": steps[0]["t"] - start,
        "last_prefill_end_s": last_prefill - start,
        "prefill_tokens": sum(s["prefill_tokens"] for s in prefilling),
        "prefill_seqs_per_step": (
            sum(s["prefill_seqs"] for s in prefilling) / len(prefilling) if prefilling else 0.0
        ),
        "ahead_steps": sum(1 for s in steps if s["ahead"]),
    }
    for kind, rows in kinds.items():
        out[f"{kind}_steps"] = len(rows)
        out[f"{kind}_s"] = sum(s["dt"] for s in rows)
    return out


def format_summary(name: str, s: dict) -> str:
    if not s.get("steps"):
        return f"{name}: no steps"
    return (
        f"{name}: {s['steps']} steps in {s['wall_s'] * 1e3:.0f} ms (busy {s['busy_s'] * 1e3:.0f}, idle "
        f"{s['idle_s'] * 1e3:.0f}); prefill-only {s['prefill_steps']} / {s['prefill_s'] * 1e3:.0f} ms, mixed "
        f"{s['mixed_steps']} / {s['mixed_s'] * 1e3:.0f} ms, decode {s['decode_steps']} / "
        f"{s['decode_s'] * 1e3:.0f} ms ({s['ahead_steps']} ahead); {s['prefill_tokens']} prefill tokens, "
        f"{s['prefill_seqs_per_step']:.1f} prompts per prefilling step, last prefill ended at "
        f"{s['last_prefill_end_s'] * 1e3:.0f} ms, first step at {s['first_step_after_s'] * 1e3:.0f} ms"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", type=Path, help="the FP4MOE_STEP_TRACE file")
    p.add_argument(
        "--from", dest="start", type=float, default=float("-inf"), help="window start (monotonic s)"
    )
    p.add_argument("--to", dest="end", type=float, default=float("inf"), help="window end (monotonic s)")
    args = p.parse_args()
    steps = read(args.trace, args.start, args.end)
    print(format_summary(str(args.trace), summary(steps)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
