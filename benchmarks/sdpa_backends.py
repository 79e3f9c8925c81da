# ruff: noqa: B023  (each closure is called inside the loop iteration that defines it)
"""Attention of a fresh causal prompt at the model's shapes (16 query heads, 2 KV heads, head dim 256, bf16)
through PyTorch's SDPA backends on the GPU: flash attention (PyTorch's FA2 build), cuDNN's, and the
memory-efficient one, with GQA by ``enable_gqa`` or with the KV heads repeated; and cuDNN's cost at a new
shape (it builds a plan for each: the first call at a length against the calls after it). FLOPs: 4 x heads x
head dim x n^2 / 2 (QK^T and PV, causal half). Differences are against flash attention's output.

    python3 benchmarks/sdpa_backends.py --lengths 8192 4096 2048 512 --out sdpa.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from common import event_seconds, log
from provenance import write_result
from torch.nn.attention import SDPBackend, sdpa_kernel

HEADS, KV_HEADS, DIM = 16, 2, 256
BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 4096, 2048, 512], help="prompt lengths")
    ap.add_argument("--new-shapes", type=int, nargs="+", default=[8000, 8001, 4100, 3000],
                    help="lengths for cuDNN's first-call cost (the first also pays for loading its library)")  # fmt: skip
    ap.add_argument("--out", default="", help="write the rows to this JSON file")
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for n in args.new_shapes:
        q = torch.randn(1, HEADS, n, DIM, device=dev, dtype=torch.bfloat16)
        k = torch.randn(1, KV_HEADS, n, DIM, device=dev, dtype=torch.bfloat16)
        torch.cuda.synchronize()
        start = time.perf_counter()
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)
        torch.cuda.synchronize()
        rows.append(dict(kind="cudnn-first-call", n=n, seconds=time.perf_counter() - start))
        log(f"cuDNN, first call at n = {n}: {rows[-1]['seconds'] * 1e3:.1f} ms")
    for n in args.lengths:
        q = torch.randn(1, HEADS, n, DIM, device=dev, dtype=torch.bfloat16)
        k = torch.randn(1, KV_HEADS, n, DIM, device=dev, dtype=torch.bfloat16)
        v = torch.randn(1, KV_HEADS, n, DIM, device=dev, dtype=torch.bfloat16)
        flops = 4 * HEADS * DIM * n * n / 2
        ref = None
        for name, backend in BACKENDS.items():
            for gqa in (True, False):
                kk, vv = (k, v) if gqa else (x.repeat_interleave(HEADS // KV_HEADS, 1) for x in (k, v))

                def run():
                    with sdpa_kernel(backend):
                        return F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=gqa)

                try:
                    out = run().float()
                except RuntimeError as e:
                    log(f"n = {n} {name} gqa={gqa}: not available ({str(e)[:80]})")
                    continue
                ref = out if ref is None else ref
                t = statistics.median(event_seconds(run, 10))
                diff = float((out - ref).abs().max())
                rows.append(dict(kind=name, gqa=gqa, n=n, seconds=t, tflops=flops / t / 1e12, max_diff=diff))
                log(f"n = {n} {name:9s} gqa={gqa}: {t * 1e3:.3f} ms, {flops / t / 1e12:.0f} TFLOP/s, "
                    f"max |diff| {diff:.1e}")  # fmt: skip
    if args.out:
        write_result(args.out, dict(device=torch.cuda.get_device_name(), rows=rows), indent=1)


if __name__ == "__main__":
    main()
