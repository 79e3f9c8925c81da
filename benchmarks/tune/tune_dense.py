# ruff: noqa: B023  (each closure is called inside the loop iteration that defines it)
"""The decode step's bf16 projections at the full-size shapes, cuBLAS against our grouped kernel's dense
branch (``nvfp4_gemm._dense`` with bf16 weights, tensor cores on up to 16 rows) and our GEMV on the CUDA
cores (``nvfp4_gemv.bf16_gemv``, up to 4 rows), timed the way the engine
runs them: one CUDA graph of 40 launches over 40 different weight copies (nothing served from L2), median
over replays, per launch; GB/s over the weight bytes.

    python3 benchmarks/tune/tune_dense.py --out tune-dense.json
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, provenance.py
from common import LAYERS, graph_time  # noqa: E402
from provenance import write_result

from fp4moe.kernels import nvfp4_gemm as gemm
from fp4moe.kernels import nvfp4_gemv as gemv

GEMV_CONFIGS = [
    gemv.GemvTiles(bn, bk, wa, 3, sum_each=True)
    for bn, bk, wa in itertools.product((4, 8, 16), (512, 1024), (4, 8))
] + [gemv.GemvTiles(8, 512, 4, 3), gemv.GemvTiles(16, 256, 4, 3)]

# (name, N, K) of the bf16 matrices a decode step multiplies (Qwen3.5-35B-A3B)
SHAPES = [
    ("deltanet in_proj (qkv, z, b, a)", 12352, 2048),
    ("deltanet out_proj", 2048, 4096),
    ("attention q (gated), k, v", 9216, 2048),
    ("router + shared gate/up", 1281, 2048),
    ("router + shared gate/up, padded", 1288, 2048),  # as the engine runs it (FusedLinear pad_to=8)
    ("shared down", 2048, 512),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,3,16", help="activation rows (tokens) per launch")
    ap.add_argument("--budget", type=float, default=150, help="seconds of sweeping before it stops early")
    ap.add_argument("--shapes", default="", help="only the shapes whose name contains this text")
    ap.add_argument("--out", default="", help="write every timing to this JSON file")
    ap.add_argument(
        "--kernels",
        default="mma,gemv",
        help="ours to time: mma (tensor-core tiles), gemv (CUDA cores, M <= 4)",
    )
    args = ap.parse_args()
    dev = torch.device("cuda")
    one = torch.ones(1, device=dev)
    t0 = time.time()
    results = dict(device=torch.cuda.get_device_name(), rows=[])
    configs = [
        gemm.Tiles(bn, bk, wa, st)
        for bn, bk, wa, st in itertools.product((16, 32, 64), (128, 256), (4, 8), (3, 5))
    ]
    for name, n, k in [sh for sh in SHAPES if args.shapes in sh[0]]:
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
        nbytes = n * k * 2
        for m in [int(x) for x in args.rows.split(",")]:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)

            def cublas():
                for w in ws:
                    torch.nn.functional.linear(x, w, out=out)

            base = graph_time(cublas)
            best = (base, "cuBLAS")

            def ours(cfg):
                for w in ws:
                    if isinstance(cfg, gemv.GemvTiles):
                        gemv.bf16_gemv(x, w, out=out, tiles=cfg)
                    else:
                        gemm._launch(
                            x, (x.stride(0), 0), 0, w, w, 0, one, out, None, one, n, k, 1, 0, 0, cfg, dense_m=m
                        )  # fmt: skip

            mma = configs if "mma" in args.kernels else []
            for cfg in mma + (GEMV_CONFIGS if m <= 4 and "gemv" in args.kernels else []):
                if cfg in mma and time.time() - t0 > args.budget:  # (the budget bounds the tile sweep)
                    continue
                try:
                    s = graph_time(lambda cfg=cfg: ours(cfg))
                except Exception as exc:
                    print(f"skip {cfg}: {type(exc).__name__}: {str(exc)[:80]}", flush=True)
                    continue
                results["rows"].append(dict(shape=name, m=m, cfg=repr(cfg), us=s * 1e6, gbs=nbytes / s / 1e9))
                best = min(best, (s, repr(cfg)))
            results["rows"].append(
                dict(shape=name, m=m, cfg="cuBLAS", us=base * 1e6, gbs=nbytes / base / 1e9)
            )
            print(
                f"{name:32s} M={m:2d}: cuBLAS {base * 1e6:6.1f} us ({nbytes / base / 1e9:5.0f} GB/s), "
                f"best {best[0] * 1e6:6.1f} us ({nbytes / best[0] / 1e9:5.0f} GB/s) {best[1]}",
                flush=True,
            )
    if args.out:
        write_result(args.out, results, indent=1)


if __name__ == "__main__":
    main()
