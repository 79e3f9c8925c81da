"""Where a continuing prefill chunk's time goes: the full-size model with random weights (NVFP4 routed
experts, bf16 rest), one sequence with a ``--prefix``-token prompt already prefilled (one step), then a
``--chunk``-token chunk over it (as a served prompt one step longer than the step budget runs its tail, or a
prefix-cache hit its new tokens; prefix 0: a fresh prompt): through the runner's module path (``hidden_states``) and through the
prefill graphs (``CudaModelRunner.chunk_graphs``, ``prompt_graphs``). Per (path, prefix, chunk):
the chunk's device time (CUDA events) and host time (to enqueue it, and until it is done), median of
``--repeats``; then (``--profile``) one more module-path chunk under torch's profiler (ops by self CPU time, kernels by
device time) and under cProfile (Python functions by cumulative time).

    python3 benchmarks/chunk_profile.py --prefix 8192 512 --chunk 93 512 --profile --out chunk-profile.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import common
import torch
from common import _kernel_table, build_model, log
from provenance import write_result


def chunk_runner(model, max_len: int, kv: str):
    from fp4moe.engine.runner.cuda_runner import CudaModelRunner

    runner = CudaModelRunner(
        model, None, model.embed_tokens.device, kv, max_num_seqs=1, max_model_len=max_len + 64,
        num_pages=max_len // 64 + 4, cuda_graphs=True,
    )  # fmt: skip
    common.set_kv_scales(runner, model)
    return runner


def graph_step(runner, model, ids, start: int, n: int):
    """The chunk as the engine runs it (``CudaModelRunner.forward``: its graph when one takes it) -> a call."""
    from fp4moe.engine.request.sampler import SamplingParams
    from fp4moe.engine.request.sequence import Sequence

    seq = Sequence(0, ids[: start + n].tolist(), SamplingParams(max_tokens=1), slot=0, num_cached=start)

    def run():
        hidden, _ = runner.forward([(seq, n)], runner.kv, runner.states)
        return model.compute_logits(hidden[-1:])

    return run


def step(runner, model, ids, start: int, n: int):
    """One step of ``n`` tokens at ``start`` for slot 0 -> the last row's logits."""
    from fp4moe.engine.reference.context import StepContext

    dev = ids.device
    ctx = StepContext([n], [start], [0], runner.kv, runner.states)
    h = runner.hidden_states(ids[start : start + n], torch.arange(start, start + n, device=dev), ctx)
    return model.compute_logits(h[-1:])


def measure(runner, model, ids, prefix: int, chunk: int, repeats: int, graph: bool) -> dict:
    dev = ids.device
    device_s, enqueue_s, done_s = [], [], []
    for _ in range(repeats + 1):  # the first compiles
        runner.kv.free(0)
        if prefix:
            step(runner, model, ids, 0, prefix)
        if graph:
            run = graph_step(runner, model, ids.cpu(), prefix, chunk)
        else:
            run = lambda: step(runner, model, ids, prefix, chunk)  # noqa: E731
        torch.cuda.synchronize(dev)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        a.record()
        run()
        b.record()
        t1 = time.perf_counter()
        b.synchronize()
        t2 = time.perf_counter()
        device_s.append(a.elapsed_time(b) / 1e3)
        enqueue_s.append(t1 - t0)
        done_s.append(t2 - t0)
    m = statistics.median
    return dict(path="graph" if graph else "modules", prefix=prefix, chunk=chunk, device_s=m(device_s[1:]),
                enqueue_s=m(enqueue_s[1:]), done_s=m(done_s[1:]), first_done_s=done_s[0], runs=repeats)  # fmt: skip


def profiles(runner, model, ids, prefix: int, chunk: int, top: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    dev = ids.device
    runner.kv.free(0)
    step(runner, model, ids, 0, prefix)
    torch.cuda.synchronize(dev)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step(runner, model, ids, prefix, chunk)
        torch.cuda.synchronize(dev)
    ops = [
        dict(op=ev.key[:100], calls=ev.count, self_cpu_us=ev.self_cpu_time_total)
        for ev in prof.key_averages()
    ]
    ops.sort(key=lambda r: -r["self_cpu_us"])
    kernels = _kernel_table(prof, None)
    # cProfile: the same chunk again, over a fresh prefill of the same prefix
    runner.kv.free(0)
    step(runner, model, ids, 0, prefix)
    torch.cuda.synchronize(dev)
    pr = cProfile.Profile()
    pr.enable()
    step(runner, model, ids, prefix, chunk)
    torch.cuda.synchronize(dev)
    pr.disable()
    text = io.StringIO()
    pstats.Stats(pr, stream=text).sort_stats("cumulative").print_stats(top)
    return dict(ops=ops[:top], kernels=kernels[:top], kernel_us=sum(k["us"] for k in kernels),
                cprofile=text.getvalue())  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--prefix", type=int, nargs="+", default=[8192, 512], help="tokens cached before the chunk"
    )
    ap.add_argument("--chunk", type=int, nargs="+", default=[93, 512], help="continuing chunk lengths")
    ap.add_argument("--kv", default="fp8", choices=["fp8", "auto"], help="KV cache dtype")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per (prefix, chunk); the median")
    ap.add_argument(
        "--profile", action="store_true", help="profile the first (prefix, chunk) on the module path"
    )
    ap.add_argument("--top", type=int, default=30, help="rows of each profile table")
    ap.add_argument("--out", default="", help="write the results to this JSON file")
    args = ap.parse_args()
    dev = torch.device("cuda")
    model = build_model(True, dev)
    longest = max(args.prefix) + max(args.chunk)
    runner = chunk_runner(model, longest, args.kv)
    ids = torch.randint(0, model.args.vocab_size, (longest,), device=dev)
    rows = []
    for graph in (False, True):
        for prefix in args.prefix:
            for chunk in args.chunk:
                r = measure(runner, model, ids, prefix, chunk, args.repeats, graph)
                rows.append(r)
                log(f"{r['path']:7s} prefix {prefix:6d} chunk {chunk:5d}: device {r['device_s'] * 1e3:7.1f} ms, enqueue "
                    f"{r['enqueue_s'] * 1e3:7.1f} ms, done {r['done_s'] * 1e3:7.1f} ms (first {r['first_done_s'] * 1e3:.0f})")  # fmt: skip
    p = profiles(runner, model, ids, args.prefix[0], args.chunk[0], args.top) if args.profile else {}
    if p:
        log(f"profile, prefix {args.prefix[0]}, chunk {args.chunk[0]}: kernels {p['kernel_us'] / 1e3:.1f} ms")
        for r in p["kernels"]:
            log(f"  {r['us'] / 1e3:8.2f} ms x{r['calls']:5d}  {r['kernel']}")
        log("ops by self CPU time:")
        for r in p["ops"]:
            log(f"  {r['self_cpu_us'] / 1e3:8.2f} ms x{r['calls']:5d}  {r['op']}")
        log(p["cprofile"])
    if args.out:
        write_result(args.out, dict(rows=rows, profile=p, kv=args.kv), repeats=args.repeats, indent=1)


if __name__ == "__main__":
    main()
