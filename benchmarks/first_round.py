"""Where a fresh greedy request's first speculative round goes (issue 20): the full-size model with random
weights (``--load-format dummy``), k = 2 with forced 80% acceptance, one 512-token prompt at a time. Times
``MTPSpeculator._first_drafts`` (CUDA-synchronized) and 1-, 2- and 16-token generates, then profiles one
``_first_drafts`` call with torch's profiler (host and device time per op): with the first drafts' graphs
(``FirstDrafts``) and without (the eager MTP rows), in the same process.

    python3 benchmarks/first_round.py --out first-round.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

import torch
from provenance import write_result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pp", type=int, default=512, help="prompt tokens (default 512)")
    ap.add_argument("--runs", type=int, default=6, help="timed runs; the median is reported (default 6)")
    ap.add_argument("--out", default="", help="write the results to this JSON file")
    args = ap.parse_args()
    os.environ.setdefault("FP4MOE_FORCE_ACCEPTANCE", "0.8")
    from fp4moe.engine.front.llm import LLM
    from fp4moe.engine.request.sampler import SamplingParams
    from fp4moe.engine.spec import spec_decode
    from fp4moe.models.full_size import resolve

    llm = LLM(resolve("qwen3.6-35b-a3b-nvfp4", "dummy"), device="cuda", load_format="dummy", max_num_seqs=64,
              max_model_len=16384, num_speculative_tokens=2, kv_cache_dtype="fp8")  # fmt: skip
    print(f"warm-up {llm.warmup.run(llm.engine_config.max_num_batched_tokens):.1f} s", flush=True)
    orig = spec_decode.MTPSpeculator._first_drafts
    times, profile = [], {}

    def timed(self, seqs, kv):
        torch.cuda.synchronize()
        t = time.perf_counter()
        if profile.get("on"):
            acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=acts) as p:
                out = orig(self, seqs, kv)
                torch.cuda.synchronize()
            profile["cpu"] = p.key_averages().table(sort_by="cpu_time_total", row_limit=40)
            profile["cuda"] = p.key_averages().table(sort_by="cuda_time_total", row_limit=20)
            profile["on"] = False
        else:
            out = orig(self, seqs, kv)
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        return out

    spec_decode.MTPSpeculator._first_drafts = timed
    results = {}
    for mode in ("graph", "eager"):
        llm.runner.first_drafts.use_graphs = mode == "graph"
        times.clear()
        profile.clear()
        rng = random.Random(0)
        gen = {1: [], 2: [], 16: []}
        for run in range(args.runs):
            for n in (1, 2, 16):
                prompt = [rng.randrange(1000, 100000) for _ in range(args.pp)]
                torch.cuda.synchronize()
                t = time.perf_counter()
                llm.generate(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
                torch.cuda.synchronize()
                gen[n].append(time.perf_counter() - t)
            if run == args.runs - 2:
                profile["on"] = True
        results[mode] = dict(
            first_drafts_ms=[t * 1e3 for t in times],
            generate_ms={n: [t * 1e3 for t in v] for n, v in gen.items()},
            median_first_drafts_ms=statistics.median(times[1:]) * 1e3,
            median_generate_ms={n: statistics.median(v[1:]) * 1e3 for n, v in gen.items()},
            profile_cpu=profile.get("cpu"),
            profile_cuda=profile.get("cuda"),
        )
        summary = {k: v for k, v in results[mode].items() if not k.startswith("profile")}
        print(mode, json.dumps(summary, indent=1))
        print(profile.get("cpu", ""))
        print(profile.get("cuda", ""))
    llm.runner.first_drafts.use_graphs = True
    if args.out:
        write_result(args.out, results, repeats=args.runs, indent=1)


if __name__ == "__main__":
    main()
