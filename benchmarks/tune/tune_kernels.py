# ruff: noqa: B023  (each lambda is called at once, inside the loop)
"""Configuration sweep for the small decode kernels at the full-size shapes (hidden 2048, 256 experts top-8,
Gated DeltaNet 16/32 heads of 128): median time per launch (triton.testing.do_bench; it includes Triton's
host launch overhead of ~15-20 us, so only the larger kernels' rankings mean much) and GB/s over the bytes
each launch must move. Prints the best configs. The expert GEMMs are tuned by ``tune_experts.py`` (graph
replays over 40 layers' experts).

    python benchmarks/tune/tune_kernels.py
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton

from fp4moe.kernels import gdn_decode as gdn_k
from fp4moe.kernels import moe_router, norm
from fp4moe.kernels import moe_routing as mr


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median") * 1e-3


def best(rows, label, top=3):
    rows.sort(key=lambda r: r[0])
    for t, cfg, gbs in rows[:top]:
        print(f"{label} {cfg}: {t * 1e6:7.1f} us {'' if gbs is None else f'{gbs:6.0f} GB/s'}", flush=True)


def main() -> None:
    argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()
    dev = torch.device("cuda")
    e, h, k = 256, 2048, 8
    for t in (1, 16, 64):
        ids = torch.stack([torch.randperm(e, device=dev)[:k] for _ in range(t)]).to(torch.int32)
        rows = []
        for warps in (1, 2, 4, 8):
            rows.append((bench(lambda warps=warps: mr.align(ids, e, 16, num_warps=warps)), warps, None))
        best(rows, f"T={t:3d} align warps=")
        proj = torch.randn(t, e + 2 * 512 + 1, device=dev, dtype=torch.bfloat16)
        rows = [
            (bench(lambda nw=nw: moe_router.route(proj, e, k, 512, num_warps=nw)), nw, None)
            for nw in (1, 2, 4, 8)
        ]
        best(rows, f"T={t:3d} router warps=")
        hh = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
        y = torch.randn(t * k, h, device=dev)
        wn = torch.zeros(h, device=dev, dtype=torch.bfloat16)
        rows = [
            (
                bench(lambda nw=nw: norm.moe_combine(hh, y, k, hh, proj, e + 1024, wn, 1e-6, num_warps=nw)),
                nw,
                None,
            )
            for nw in (2, 4, 8, 16)
        ]
        best(rows, f"T={t:3d} combine warps=")
        rows = [
            (bench(lambda nw=nw: norm.add_rms_norm(hh, hh, wn, 1e-6, num_warps=nw)), nw, None)
            for nw in (2, 4, 8, 16)
        ]
        best(rows, f"T={t:3d} add_norm warps=")
        # Gated DeltaNet decode: state bytes read + written dominate
        hk, hv, dk, dv = 16, 32, 128, 128
        conv_dim = 2 * hk * dk + hv * dv
        gproj = torch.randn(t, conv_dim + hv * dv + 2 * hv, device=dev, dtype=torch.bfloat16)
        conv_w = torch.randn(conv_dim, 4, device=dev, dtype=torch.bfloat16)
        ring = torch.randn(t, 4, conv_dim, device=dev, dtype=torch.bfloat16)
        state = torch.randn(t, hv, dk, dv, device=dev) * 0.01
        slots = torch.arange(t, device=dev, dtype=torch.int32)
        pos = torch.full((t,), 100, device=dev, dtype=torch.int32)
        ones = torch.ones(hv, device=dev)
        nw_ = torch.ones(dv, device=dev, dtype=torch.bfloat16)
        sbytes = t * hv * dk * dv * 4 * 2
        rows = []
        for vs, warps in itertools.product((1, 2, 4, 8), (2, 4, 8, 16)):
            fn = lambda vs=vs, warps=warps: gdn_k.gdn_decode(  # noqa: E731
                gproj,
                conv_w,
                ring,
                state,
                slots,
                pos,
                ones,
                ones,
                nw_,
                1e-6,
                (hk, hv, dk, dv),
                v_splits=vs,
                num_warps=warps,
            )
            try:
                s = bench(fn)
            except Exception as exc:
                print(f"skip gdn {vs, warps}: {type(exc).__name__}")
                continue
            rows.append((s, (vs, warps), sbytes / s / 1e9))
        best(rows, f"T={t:3d} gdn (v_splits, warps)=")


if __name__ == "__main__":
    main()
