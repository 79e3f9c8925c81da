"""Tile sweep for the grouped NVFP4 expert kernels at the full-size decode shapes (E=256, H=2048, I=512,
top-8): median time per launch (triton.testing.do_bench) and GB/s over the distinct expert bytes.

    python benchmarks/tune_moe.py
"""

from __future__ import annotations

import itertools

import torch
import triton

from fp4moe.kernels import nvfp4_gemm as gemm


def main() -> None:
    dev = torch.device("cuda")
    e, h, i, k = 256, 2048, 512, 8
    gu_p = torch.randint(0, 256, (e, 2 * i, h // 2), dtype=torch.uint8, device=dev)
    gu_s = (torch.rand(e, 2 * i, h // 16, device=dev) + 0.5).to(torch.float8_e4m3fn)
    gu_d = torch.full((e, 2), 2e-3, device=dev)
    dn_p = torch.randint(0, 256, (e, h, i // 2), dtype=torch.uint8, device=dev)
    dn_s = (torch.rand(e, h, i // 16, device=dev) + 0.5).to(torch.float8_e4m3fn)
    dn_d = torch.full((e,), 2e-3, device=dev)
    per_expert_gu = 2 * i * h // 2 + 2 * i * h // 16
    per_expert_dn = h * i // 2 + h * i // 16
    for t in (1, 16, 64):
        ids = torch.stack([torch.randperm(e, device=dev)[:k] for _ in range(t)])
        w = torch.rand(t, k, device=dev)
        x = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
        routing = gemm.align(ids, e, 16)
        distinct = ids.unique().numel()
        act = gemm.moe_gate_up(x, gu_p, gu_s, gu_d, routing, k)
        for op, _n, kk, nbytes in (
            ("gate_up", i, h, distinct * per_expert_gu),
            ("down", h, i, distinct * per_expert_dn),
        ):
            results = []
            for bn, bk, warps, stages in itertools.product(
                (16, 32, 64, 128), (64, 128, 256, 512), (2, 4, 8), (2, 3, 4)
            ):
                if bk > kk:
                    continue
                tiles = (bn, bk, warps, stages)
                try:
                    if op == "gate_up":
                        fn = lambda: gemm.moe_gate_up(x, gu_p, gu_s, gu_d, routing, k, tiles=tiles)  # noqa: E731,B023
                    else:
                        fn = lambda: gemm.moe_down(act, dn_p, dn_s, dn_d, routing, w, tiles=tiles)  # noqa: E731,B023
                    ms = triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median")
                except Exception as exc:  # out of resources for a tile shape
                    print(f"skip {tiles}: {type(exc).__name__}")
                    continue
                results.append((ms, tiles))
            results.sort()
            for ms, tiles in results[:3]:
                print(f"T={t:3d} {op:7s} tiles={tiles}: {ms * 1e3:7.1f} us, {nbytes / ms / 1e6:6.0f} GB/s")


if __name__ == "__main__":
    main()
