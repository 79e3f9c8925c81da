"""Prefill of many prompts in one step vs one long prompt (issue 20): the same number of tokens through the
GPU runner's prefill path (``CudaModelRunner.hidden_states``), split into ``n`` sequences. A server's
prefill steps are of the split kind (pp 512 at concurrency 64: four 512-token prompts per 2,048-token step),
the decode benchmark's of the single kind.

    python benchmarks/prefill_batch.py --tokens 8192 --splits 1 4 16 64 --profile 16 --out $OUT/prefill_batch.json
    python benchmarks/prefill_batch.py --tokens 512 --splits 1 4 --graphs --out $OUT/prefill_graphs.json

``--graphs``: the step as the engine runs fresh prompts (``CudaModelRunner.forward``: a captured prefill
graph where the prompts fit one, the module path otherwise), each row saying which it took.

Per split: device time (CUDA events, median of 3), the host's time to enqueue the step (when it is close to
the device time, the step waits on Python), tok/s; ``--profile N``: torch profiler on the N-way split, the
ops by self host time and the kernels by device time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from provenance import write_result

sys.path.insert(0, str(Path(__file__).parent))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192, help="tokens per step")
    p.add_argument("--splits", type=int, nargs="+", default=[1, 4, 16, 64], help="sequences per step")
    p.add_argument(
        "--profile", default=None, metavar="N | LEN[xN],...",
        help="profile the step of this many sequences (of --tokens in all) or of these prompt lengths, through "
        "the module path",
    )  # fmt: skip
    p.add_argument(
        "--prefill-graph-tokens", type=int, default=None,
        help="rows per prefill graph at most (the engine's default: its step budget; this runner's: 2,048)",
    )  # fmt: skip
    p.add_argument(
        "--graphs", action="store_true", help="through the runner's prefill graphs where they apply"
    )
    p.add_argument(
        "--lengths", nargs="*", default=[], metavar="LEN[xN],...",
        help="also steps of these prompt lengths, e.g. 466,524x13,530 (a served step's 15 prompts); with "
        "--graphs each such step runs through the graphs and through the module path",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args()
    import common

    from fp4moe.engine.reference.context import StepContext
    from fp4moe.engine.request.sampler import SamplingParams
    from fp4moe.engine.request.sequence import Sequence
    from fp4moe.engine.runner.cuda_runner import CudaModelRunner

    steps = [[args.tokens // n] * n for n in args.splits] + [_lengths(x) for x in args.lengths]
    dev = torch.device("cuda")
    model = common.build_model(True, dev)
    spec = args.profile
    profiled = (
        None if not spec else [args.tokens // int(spec)] * int(spec) if spec.isdigit() else _lengths(spec)
    )
    sizes = steps + ([profiled] if profiled else [])
    n_max, longest = max(len(x) for x in sizes), max(max(x) for x in sizes)
    runner = CudaModelRunner(
        model, None, dev, "auto", max_num_seqs=n_max, max_model_len=max(args.tokens, longest) + 64,
        num_pages=n_max * (max(args.tokens, longest) // 64 + 2), cuda_graphs=args.graphs,
        **({"prefill_graph_tokens": args.prefill_graph_tokens} if args.prefill_graph_tokens else {}),
    )  # fmt: skip
    host: list[float] = []
    groups: list = []  # the last step's prefill graphs (sequences, rows each)

    def step(lens: list[int]):
        n = len(lens)
        for s in range(n):
            runner.kv.free(s)
        if args.graphs:  # fresh sequences through the engine's entry point
            seqs = [Sequence(s, torch.randint(0, model.args.vocab_size, (m,)).tolist(), SamplingParams(), slot=s)
                    for s, m in enumerate(lens)]  # fmt: skip
            batch = [(q, m) for q, m in zip(seqs, lens, strict=True)]
            groups[:] = [bucket for _, bucket in runner._prompt_groups(batch, runner.kv)]
            start = time.perf_counter()
            h, _ = runner.forward(batch, runner.kv, runner.states)
            host.append(time.perf_counter() - start)
            return h
        ids = torch.randint(0, model.args.vocab_size, (sum(lens),), device=dev)
        pos = torch.cat([torch.arange(m, device=dev) for m in lens])
        ctx = StepContext(lens, [0] * n, list(range(n)), runner.kv, runner.states)
        start = time.perf_counter()
        h = runner.hidden_states(ids, pos, ctx)
        host.append(time.perf_counter() - start)
        return h

    rows = []
    for i, lens in enumerate(steps):
        explicit = i >= len(args.splits)
        for graphs in [True, False] if args.graphs and explicit else [args.graphs]:
            runner.use_prompt_graphs = graphs
            step(lens)  # compiles
            torch.cuda.synchronize()
            host.clear()
            times = common.event_seconds(lambda lens=lens: step(lens), 3)
            t, tokens = statistics.median(times), sum(lens)
            graph = list(groups) if graphs else None
            rows.append(dict(sequences=len(lens), tokens=tokens, lengths=lens, seconds=t,
                             host_s=statistics.median(host), tokens_per_s=tokens / t,
                             graph=graph or None))  # fmt: skip
            print(f"{len(lens):3d} prompts, {tokens:6d} tokens: {t * 1e3:7.1f} ms, host "
                  f"{rows[-1]['host_s'] * 1e3:7.1f} ms, {rows[-1]['tokens_per_s']:8.0f} tok/s"
                  + (f", graphs {rows[-1]['graph']}" if graph else ", module path"), flush=True)  # fmt: skip
    result = dict(device=torch.cuda.get_device_name(), rows=rows)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        lens = profiled
        runner.use_prompt_graphs = False
        step(lens)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step(lens)
            torch.cuda.synchronize()
        avg = prof.key_averages()
        by_host = sorted(avg, key=lambda e: -e.self_cpu_time_total)[:25]
        result["host_ops"] = [
            dict(op=e.key[:90], calls=e.count, self_host_us=e.self_cpu_time_total) for e in by_host
        ]
        result["kernels"] = common._kernel_table(prof, 25)
        print(f"\nprofile, {args.profile} sequences: ops by self host time")
        for r in result["host_ops"]:
            print(f"  {r['self_host_us'] / 1e3:8.2f} ms  {r['calls']:6d}  {r['op']}")
        print("kernels by device time")
        for r in result["kernels"]:
            print(f"  {r['us'] / 1e3:8.2f} ms  {r['calls']:6d}  {r['kernel']}")
    if args.out:
        write_result(args.out, result)
    return 0


def _lengths(spec: str) -> list[int]:
    """'466,524x13,530' -> [466, 524, ..., 524, 530]."""
    out = []
    for part in spec.split(","):
        length, _, count = part.partition("x")
        out += [int(length)] * int(count or 1)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
