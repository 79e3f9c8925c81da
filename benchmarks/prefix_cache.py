"""Time to first token of a long prompt repeated with one new last token, prefix cache off vs on.

    python benchmarks/prefix_cache.py [--model DIR] [--tokens 2000] [--block 64] [--repeats 5]

Without --model it builds the tiny fixture checkpoint in a temporary directory (CPU, float32).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from fp4moe.engine.front.llm import LLM
from fp4moe.engine.loop.core import EngineCore
from fp4moe.engine.loop.prefix_cache import PrefixCache
from fp4moe.engine.loop.scheduler import SchedulerConfig
from fp4moe.engine.request.sampler import SamplingParams
from fp4moe.models.tiny import write_tiny_checkpoint


def ttft(llm: LLM, core: EngineCore, prompt: list[int]) -> float:
    seq = llm.make_sequences(prompt, SamplingParams(max_tokens=1, temperature=0))[0]
    core.add([seq])
    t = time.perf_counter()
    while not seq.finished:
        core.step()
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint dir (default: a tiny random one)")
    p.add_argument("--tokens", type=int, default=2000, help="shared prompt length (default 2000)")
    p.add_argument("--block", type=int, default=64, help="prefix-cache block size in tokens (default 64)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats; medians reported (default 5)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(args.model or write_tiny_checkpoint(tmp), dtype="float32")
        base = [10 + i % 1000 for i in range(args.tokens)]
        for label, cache in (("off", None), ("on", PrefixCache(args.block, 8))):
            core = llm.new_core(SchedulerConfig(max_num_batched_tokens=2 * args.tokens), prefix_cache=cache)
            times = [ttft(llm, core, base[:-1] + [i]) for i in range(args.repeats + 1)]
            reused = cache.hits // args.repeats if cache else 0
            print(
                f"prefix cache {label}: first {times[0]:.3f} s, repeats median {statistics.median(times[1:]):.3f} s, "
                f"{reused} of {args.tokens} prompt tokens reused per repeat"
            )


if __name__ == "__main__":
    main()
