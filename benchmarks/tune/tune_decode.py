"""Launch settings of the decode step, measured where they matter: inside the captured step of the full-size
model. Each variant changes one setting (a kernel's warps or tiles, the Gated DeltaNet value splits,
programmatic dependent launch's early triggers, the shared expert's side stream), the step is recaptured and
its graph replayed; the default settings run between every two variants, and each variant is reported
against the defaults beside it. Variants equal to a default (where a default changed since) measure the
noise. ``--profile``: a per-kernel breakdown of each batch's step too (eager launches under the profiler).

A kernel timed alone in a loop of its own launches hides or adds latency that the step's chain of ~500
dependent kernels does not (tune_kernels.py, tune_dense.py and tune_experts.py time them so); this times the
chain.

    python3 benchmarks/tune/tune_decode.py --out tune-decode.json      # on one GPU (the H200)
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, provenance.py
from common import build_model, event_seconds, kernel_breakdown, log, random_runner  # noqa: E402
from provenance import write_result

from fp4moe import kernels
from fp4moe.engine.runner.cuda_runner import GRAPH_BATCH_SIZES
from fp4moe.kernels import gdn_decode, moe_router, norm
from fp4moe.kernels import nvfp4_gemm as gemm
from fp4moe.kernels import nvfp4_gemv as gemv

attr = mock.patch.object  # (obj, name, value): set for the duration of a with block


def patched(module, name: str, **kwargs):
    """``module.name`` called with ``kwargs`` (over the caller's own), as a context manager."""
    orig = getattr(module, name)
    return attr(module, name, lambda *a, **k: orig(*a, **{**k, **kwargs}))


def variants(runner) -> dict:
    """name -> a context manager factory that applies the variant."""
    v = {"default": contextlib.nullcontext}
    v["pdl: no early trigger"] = lambda: attr(kernels, "_PDL", 1)
    v["no pdl"] = lambda: attr(kernels, "_PDL", 0)
    small = {  # the one-row dense GEMVs under 8192 outputs (out_proj, o_proj, router group, shared down)
        "bn 4 whole K, 8 warps": gemv.GemvTiles(4, 4096, 8, 1, sum_each=True),
        "bn 4 whole K, 4 warps": gemv.GemvTiles(4, 4096, 4, 1, sum_each=True),
        "bn 8 bk 512, 4 warps": gemv.GemvTiles(8, 512, 4, 3, sum_each=True),
    }
    large = {  # in_proj, qkv
        "bn 4 whole K, 4 warps": gemv.GemvTiles(4, 4096, 4, 1, sum_each=True),
        "bn 8 whole K, 8 warps": gemv.GemvTiles(8, 4096, 8, 1, sum_each=True),
    }
    default_tiles = gemv.dense_tiles
    for name, t in small.items():
        v[f"small dense GEMVs {name}"] = lambda t=t: attr(
            gemv, "dense_tiles", lambda n, t=t: t if n < 8192 else default_tiles(n)
        )
    for name, t in large.items():
        v[f"large dense GEMVs {name}"] = lambda t=t: attr(
            gemv, "dense_tiles", lambda n, t=t: t if n >= 8192 else default_tiles(n)
        )
    for t in (
        gemv.GemvTiles(8, 512, 4, 3, sum_each=True),
        gemv.GemvTiles(16, 512, 8, 3, sum_each=True),
        gemv.GemvTiles(32, 512, 4, 3),
        gemv.GemvTiles(8, 256, 1, 3),
        gemv.GemvTiles(4, 512, 1, 3, sum_each=True),
        gemv.GemvTiles(16, 256, 2, 3),
    ):  # the expert down GEMV's tiles (BK 512 = all of K: the first tile, loaded before the wait, is all)
        v[f"down {t}"] = lambda t=t: attr(gemv, "DOWN_TILES", t)
    for t in (  # the expert gate/up GEMV's (one or two warps: fewer barriers for layout changes)
        gemv.GemvTiles(8, 512, 1, 3, sum_each=True),
        gemv.GemvTiles(4, 512, 1, 3, sum_each=True),
        gemv.GemvTiles(8, 512, 2, 3, sum_each=True),
        gemv.GemvTiles(8, 1024, 8, 3, sum_each=True),
    ):
        v[f"gate_up {t}"] = lambda t=t: attr(gemv, "GATE_UP_TILES", t)
    for w in (1, 8):
        v[f"router {w} warps"] = lambda w=w: patched(moe_router, "route", num_warps=w)
    v["add_norm 4 warps"] = lambda: patched(norm, "add_rms_norm", num_warps=4)
    for w in (4, 16):
        v[f"combine {w} warps"] = lambda w=w: patched(norm, "moe_combine", num_warps=w)
    for splits in (2, 4, 8):
        v[f"gdn {splits} value splits"] = lambda s=splits: patched(gdn_decode, "gdn_decode", v_splits=s)
    v["shared expert on the main stream"] = lambda: attr(runner, "overlap_shared", False)
    from fp4moe.kernels import nvfp4_mma_gemv as mma

    v["route: no early trigger"] = lambda: patched(moe_router, "route", trigger="")
    v["one token: CUDA-core down GEMV"] = lambda: attr(gemm, "ONE_TOKEN_MMA_DOWN", False)
    v["one token: tensor-core down GEMV (2, 32)"] = lambda: attr(
        mma, "ONE_TOKEN_DOWN_TILES", mma.MmaTiles(2, 32)
    )
    v["experts row-major (the checkpoint's order, not expert_layout's tiles)"] = lambda: row_major_experts(
        runner.fwd.model
    )
    v["grouped GEMM for the experts (no tensor-core GEMV)"] = lambda: attr(gemm, "MMA_GEMV_MAX_TOKENS", 0)
    for gu, dn in (
        ((2, 64), (2, 32, 16)),
        ((4, 32), (2, 32, 32)),
        ((4, 64), (4, 32, 16)),
        ((2, 32), (1, 64, 16)),
    ):
        v[f"tc gemv gate_up {gu} down {dn}"] = lambda gu=gu, dn=dn: stacked(
            lambda: attr(mma, "GATE_UP_TILES", mma.MmaTiles(*gu)),
            lambda: attr(mma, "DOWN_TILES", mma.MmaTiles(*dn)),
        )
    return v


@contextlib.contextmanager
def row_major_experts(model):
    """The model's tiled NVFP4 experts back in row-major order for the duration (the kernels follow each
    ``RoutedExperts.tile``), tiled again after."""
    from fp4moe.layers.moe import RoutedExperts

    tiled = [(m, m.tile) for m in model.modules() if isinstance(m, RoutedExperts) and m.tile]
    for m, _ in tiled:
        m.untile()
    try:
        yield
    finally:
        for m, step in tiled:
            m.tile_for_kernels(step)


@contextlib.contextmanager
def stacked(*factories):
    """Several variants' context managers at once."""
    with contextlib.ExitStack() as stack:
        for f in factories:
            stack.enter_context(f())
        yield


def time_step(runner, b: int, ctx: int, replays: int) -> float:
    """Recapture the batch-``b`` step and return its median replay seconds."""
    runner.graphs.clear()
    runner._pool = None  # a fresh memory pool: the old graphs' pool cannot take a new capture
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    tokens = torch.randint(0, runner.args.vocab_size, (b,), device=runner.device)
    runner.decode_logits(list(range(b)), tokens, [ctx] * b)
    torch.cuda.synchronize()
    graph, _ = runner.graphs[runner.graph_bucket(b)]
    for _ in range(3):
        graph.replay()
    return statistics.median(event_seconds(graph.replay, replays))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="tune-decode.json", help="where to write the JSON results")
    ap.add_argument("--batches", default="1", help="batch sizes")
    ap.add_argument("--context", type=int, default=1024, help="context length of every sequence")
    ap.add_argument("--replays", type=int, default=50, help="graph replays per variant (median)")
    ap.add_argument("--only", default="", help="comma-separated substrings: run only matching variants")
    ap.add_argument("--profile", action="store_true", help="also a per-kernel breakdown of each batch's step")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    model = build_model(True, torch.device("cuda"))
    rows, profiles = [], {}
    batches = [int(x) for x in args.batches.split(",")]
    if not set(batches) <= set(GRAPH_BATCH_SIZES):
        raise SystemExit(f"--batches: captured batch sizes only, {GRAPH_BATCH_SIZES}")
    for b in batches:
        runner = random_runner(model, b, args.context, "auto", steps=8)
        vs = variants(runner)
        names = [
            n for n in vs if n != "default" and (not args.only or any(o in n for o in args.only.split(",")))
        ]
        # the default between every two variants: each variant is compared with the defaults beside it, so
        # the drift of a warming GPU (5% over a minute on the H200) cancels
        base = [time_step(runner, b, args.context, args.replays)]
        for name in names:
            with vs[name]():
                s = time_step(runner, b, args.context, args.replays)
            base.append(time_step(runner, b, args.context, args.replays))
            ref = (base[-2] + base[-1]) / 2
            rows.append(dict(batch=b, context=args.context, variant=name, us=s * 1e6, default_us=ref * 1e6,
                             ratio=s / ref, tok_s=b / s))  # fmt: skip
            log(f"B={b:3d} {name:45s} {s * 1e6:8.1f} us  (default {ref * 1e6:8.1f}: x{s / ref:.3f})")
        rows.append(dict(batch=b, context=args.context, variant="default", us=statistics.median(base) * 1e6,
                         tok_s=b / statistics.median(base)))  # fmt: skip
        log(f"B={b:3d} default median {statistics.median(base) * 1e6:8.1f} us")
        del runner
        torch.cuda.empty_cache()
    for b in batches if args.profile else ():
        # after every timing (a profiler session slows the graph replays timed after it); eager launches under
        # the profiler, so kernel times include waits for the one ahead
        profiles[b] = kernel_breakdown(model, b, args.context)
        for r in profiles[b][:14]:
            log(f"B={b:3d} {r['us']:9.1f} us  x{r['calls']:3d}  {r['kernel']}")
    out = dict(device=torch.cuda.get_device_name(), rows=rows, profiles=profiles)
    write_result(args.out, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
