"""Where one prefill's time goes on the GPU: the full-size model with random weights (decode.py's
``build_model``; NVFP4 routed experts, bf16 rest), one ``--tokens`` prompt through the runner's fused
prefill, timed (median of 3), then one more under torch's profiler: device time per kernel, grouped, and the
torch ops (with their input shapes) whose own kernels took it.

    python3 benchmarks/prefill_profile.py --tokens 8192 --out prefill-profile.json
"""

from __future__ import annotations

import argparse

import torch
from common import build_model, matmul_peak, time_prefill
from provenance import write_result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192, help="prompt length")
    ap.add_argument("--top", type=int, default=25, help="kernels to list")
    ap.add_argument("--out", default="", help="write the result to this JSON file")
    args = ap.parse_args()
    dev = torch.device("cuda")
    peak = matmul_peak(dev)
    model = build_model(True, dev)
    p = time_prefill(model, args.tokens, breakdown=True)
    p["pct_peak"], p["peak"] = p["flops"] / p["seconds"] / peak, peak
    print(f"{args.tokens} tokens: {p['seconds'] * 1e3:.1f} ms, {p['tokens_per_s']:.0f} tok/s, "
          f"{p['pct_peak']:.1%} of {peak / 1e12:.0f} TFLOP/s; kernels {p['kernel_s'] * 1e3:.1f} ms")  # fmt: skip
    for r in p["kernels"][: args.top]:
        print(f"{r['us'] / 1e3:8.2f} ms  x{r['calls']:4d}  {r['kernel']}")
    print("torch ops by their own kernels' device time, per input shape:")
    for r in p["ops"][: args.top]:
        print(f"{r['us'] / 1e3:8.2f} ms  x{r['calls']:4d}  {r['op']}  {r['shapes']}")
    if args.out:
        write_result(args.out, p, indent=1)


if __name__ == "__main__":
    main()
