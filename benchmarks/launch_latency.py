"""Kernel-to-kernel latency in a CUDA graph, with and without programmatic dependent launch (PDL): a chain
of N dependent launches of a tiny Triton kernel (each reads what the one before wrote and adds 1), captured
once and replayed; microseconds per kernel, and a check that the chain stayed ordered (every element ends at
N). This is the cost that the decode step's ~400 launches pay per kernel boundary, and what
``fp4moe.kernels.pdl_args`` buys.

    python3 benchmarks/launch_latency.py --out launch-latency.json      # on a Hopper GPU
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton
import triton.language as tl
from common import event_seconds
from provenance import write_result
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _step(x_ptr, y_ptr, N, PDL: tl.constexpr, EARLY: tl.constexpr, BLOCK: tl.constexpr):
    if PDL:
        if EARLY:  # let the next kernel start right away (it then waits inside)
            gdc_launch_dependents()
        gdc_wait()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + offs, mask=offs < N)
    tl.store(y_ptr + offs, v + 1.0, mask=offs < N)


def chain(x, y, n: int, grid: int, pdl: bool, early: bool) -> None:
    for i in range(n):
        a, b = (x, y) if i % 2 == 0 else (y, x)
        extra = {"launch_pdl": True} if pdl else {}
        _step[(grid,)](a, b, a.numel(), PDL=pdl, EARLY=early, BLOCK=a.numel() // grid, num_warps=4, **extra)


def graph_us(fn, replays: int = 20) -> tuple[torch.cuda.CUDAGraph, float]:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph, statistics.median(event_seconds(graph.replay, replays)) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", type=int, default=400, help="launches in the chain (a decode step has ~400)")
    ap.add_argument("--grids", default="1,128", help="programs per launch to try")
    ap.add_argument("--out", default="", help="write the rows to this JSON file")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (PDL: Hopper or later)")
    n, rows = args.kernels, []
    for grid in [int(g) for g in args.grids.split(",")]:
        for pdl, early in ((False, False), (True, False), (True, True)):
            x = torch.zeros(grid * 2048, device="cuda")
            y = torch.zeros_like(x)
            graph, us = graph_us(lambda x=x, y=y, g=grid, p=pdl, e=early: chain(x, y, n, g, p, e))
            x.zero_()
            y.zero_()
            graph.replay()
            torch.cuda.synchronize()
            ordered = float(x.min()) == n and float(x.max()) == n
            rows.append(dict(grid=grid, pdl=pdl, early_trigger=early, us_per_kernel=us / n, ordered=ordered))
            print(f"grid {grid:4d} PDL {pdl!s:5} early trigger {early!s:5}: {us / n:5.2f} us per kernel, "
                  f"ordered {ordered}", flush=True)  # fmt: skip
    if args.out:
        write_result(args.out, dict(device=torch.cuda.get_device_name(), kernels=n, rows=rows), indent=1)


if __name__ == "__main__":
    main()
