# ruff: noqa: B023  (each closure is called inside the loop iteration that defines it)
"""Tiles of the grouped NVFP4 expert GEMMs at prefill token counts: the row kernel (``nvfp4_gemm``, activations
as the MMA's first operand) against the weights-first kernel (``nvfp4_moe_prefill``), full-size experts
(hidden 2048, 256 experts top-8, I = 512), random routing per layer, each launch over LAYERS layers' experts in
one CUDA graph, median of replays. Each candidate is checked against the row kernel's output on the first
layer (max |difference| over max |value|: a bf16 ulp is 3.9e-3).

    python3 benchmarks/tune/tune_prefill_experts.py --tokens 8192,2048,16384 --out tune-prefill-experts.json

``--wgmma`` adds the Hopper kernels (``nvfp4_wgmma``: the weights as wgmma's register operand, K reordered) at
blocks of 128 and 64 pairs and each ring depth that fits, and times ``permute_k`` (their gate/up input's reorder,
once per layer) on its own; their errors compare gate/up's output put back in K order, and down fed the
reference activations in the kernel's order.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, provenance.py
from common import E, H, I, K, graph_time, weights  # noqa: E402
from provenance import write_result

from fp4moe.kernels import moe_routing as mr
from fp4moe.kernels import nvfp4_gemm as gemm

# (block rows, ring stages (0: stages_for), weight rows a program) of the Hopper kernels
WGMMA = [(128, 0, 64), (128, 3, 64), (64, 0, 64), (128, 0, 128), (128, 3, 128), (64, 0, 128)]

LAYERS = 6  # layers' experts and routings per graph (tune_experts' random NVFP4 experts)
# (block rows, Tiles): the row kernel's default (the reference), then weights-first candidates: the default
# (the 2026-12-04 sweep's best of 1-3 stages and other tiles, kept here as the baseline), 256-pair blocks, and
# for down two row tiles a program sharing each activation tile (``wide``: gate/up's two dots share theirs, and
# gate/up ran at 270 TFLOP/s against down's 173)
GATE_UP = [(64, gemm.Tiles(64, 128, 4, 3))] + [
    (bm, gemm.Tiles(bn, bk, w, s, weights_first=True))
    for bm, bn, bk, w, s in ((128, 64, 128, 4, 2), (256, 32, 128, 4, 2), (256, 64, 128, 8, 2), (256, 32, 64, 4, 3))
]  # fmt: skip
DOWN = [(64, gemm.Tiles(128, 64, 4, 3))] + [
    (bm, gemm.Tiles(bn, bk, w, s, weights_first=True, wide=wide))
    for bm, bn, bk, w, s, wide in (
        (128, 64, 128, 4, 3, False), (128, 64, 128, 4, 3, True), (128, 64, 128, 4, 2, True),
        (128, 64, 64, 4, 3, True), (128, 64, 64, 4, 4, True), (128, 32, 128, 4, 3, True),
        (128, 64, 128, 8, 3, True), (256, 32, 128, 4, 3, True), (256, 32, 128, 4, 3, False),
    )
]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="8192,2048,16384", help="tokens per launch")
    ap.add_argument("--budget", type=float, default=400, help="seconds of sweeping before it stops early")
    ap.add_argument("--out", default="", help="write every timing to this JSON file")
    ap.add_argument("--wgmma", action="store_true", help="also time nvfp4_wgmma's kernels (sm90)")
    ap.add_argument("--tile", type=int, default=64,
                    help="the experts' byte order (expert_layout: 64, the engine's for these shapes; 0 row-major)")  # fmt: skip
    args = ap.parse_args()
    dev = torch.device("cuda")
    start = time.time()
    ws = weights(dev, LAYERS)
    tile = args.tile  # random bytes: any order is a valid layout of some experts; every launch reads this one
    out = dict(device=torch.cuda.get_device_name(), tile=tile, rows=[])
    for t in [int(v) for v in args.tokens.split(",")]:
        gen = torch.Generator(device=dev).manual_seed(t)
        x = torch.randn(t, H, device=dev, dtype=torch.bfloat16)
        ids = [
            torch.rand(t, E, device=dev, generator=gen).topk(K, dim=1).indices.int() for _ in range(LAYERS)
        ]
        topw = torch.rand(t, K, device=dev)
        routes = {}

        def routing(bm):
            return routes.setdefault(bm, [mr.align(i, E, bm) for i in ids])

        r64 = routing(64)  # the row kernel's outputs: the reference for every candidate
        ref_act = gemm.moe_gate_up(x, *ws[0]["gu"], r64[0], K, tiles=GATE_UP[0][1], tile=tile)
        ref_y = gemm.moe_down(ref_act, *ws[0]["dn"], r64[0], topw, tiles=DOWN[0][1], tile=tile)
        act = torch.empty(t * K, I, dtype=torch.bfloat16, device=dev)
        y = torch.empty(t * K, H, dtype=torch.bfloat16, device=dev)
        row = dict(tokens=t, default_block=gemm.block_m(t, K, E), gate_up=[], down=[])
        for kind, configs, flops in (
            ("gate_up", GATE_UP, 4 * t * K * I * H),
            ("down", DOWN, 2 * t * K * H * I),
        ):
            for bm, tiles in configs:
                if time.time() - start > args.budget:
                    break
                rs = routing(bm)
                if kind == "gate_up":
                    sec = graph_time(lambda: [gemm.moe_gate_up(x, *w["gu"], r, K, out=act, tiles=tiles, tile=tile)
                                               for w, r in zip(ws, rs, strict=True)], 15, LAYERS)  # fmt: skip
                    got, ref = gemm.moe_gate_up(x, *ws[0]["gu"], rs[0], K, tiles=tiles, tile=tile), ref_act
                else:
                    sec = graph_time(lambda: [gemm.moe_down(ref_act, *w["dn"], r, topw, out=y, tiles=tiles, tile=tile)
                                               for w, r in zip(ws, rs, strict=True)], 15, LAYERS)  # fmt: skip
                    got, ref = (
                        gemm.moe_down(ref_act, *ws[0]["dn"], rs[0], topw, tiles=tiles, tile=tile),
                        ref_y,
                    )
                err = float((got.float() - ref.float()).abs().max() / ref.float().abs().max())
                row[kind].append(
                    dict(block=bm, tiles=repr(tiles), ms=sec * 1e3, tflops=flops / sec / 1e12, err=err)
                )
                print(f"T={t} {kind} bm={bm} {tiles}: {sec * 1e3:.3f} ms, {flops / sec / 1e12:.0f} TFLOP/s, "
                      f"err {err:.1e}", flush=True)  # fmt: skip
        if args.wgmma:
            _time_wgmma(row, ws, routing, x, ref_act, ref_y, topw, t, tile)
        out["rows"].append(row)
        if args.out:
            write_result(args.out, out, indent=1)


def _time_wgmma(row, ws, routing, x, ref_act, ref_y, topw, t, tile) -> None:
    """``nvfp4_wgmma``'s launches over the same layers' experts (rows ``wgmma_gate_up`` / ``wgmma_down``)."""
    from fp4moe.kernels import k_order
    from fp4moe.kernels import nvfp4_wgmma as wg

    x_perm = wg.permute_k(x)
    act_perm = wg.permute_k(ref_act)
    sec = graph_time(lambda: [wg.permute_k(x) for _ in ws], 15, LAYERS)
    row["permute_k_ms"] = sec * 1e3
    print(f"T={t} permute_k of the gate/up input: {sec * 1e3:.3f} ms a layer", flush=True)
    act = torch.empty(t * K, I, dtype=torch.bfloat16, device=x.device)
    y = torch.empty(t * K, H, dtype=torch.bfloat16, device=x.device)
    for kind, flops in (("wgmma_gate_up", 4 * t * K * I * H), ("wgmma_down", 2 * t * K * H * I)):
        row[kind] = []
        for bm, stages, wrows in WGMMA:
            rs = routing(bm)
            stages = stages or wg.stages_for(bm, kind == "wgmma_gate_up", wrows)
            if kind == "wgmma_gate_up":
                sec = graph_time(lambda: [wg.wgmma_gate_up(x_perm, *w["gu"], r, K, out=act, tile=tile, stages=stages, rows=wrows)
                                           for w, r in zip(ws, rs, strict=True)], 15, LAYERS)  # fmt: skip
                got = k_order.unpermute_k(
                    wg.wgmma_gate_up(x_perm, *ws[0]["gu"], rs[0], K, tile=tile, stages=stages, rows=wrows)
                )
                ref = ref_act
            else:
                sec = graph_time(lambda: [wg.wgmma_down(act_perm, *w["dn"], r, topw, out=y, tile=tile, stages=stages, rows=wrows)
                                           for w, r in zip(ws, rs, strict=True)], 15, LAYERS)  # fmt: skip
                got, ref = (
                    wg.wgmma_down(act_perm, *ws[0]["dn"], rs[0], topw, tile=tile, stages=stages, rows=wrows),
                    ref_y,
                )
            err = float((got.float() - ref.float()).abs().max() / ref.float().abs().max())
            row[kind].append(
                dict(block=bm, stages=stages, rows=wrows, ms=sec * 1e3, tflops=flops / sec / 1e12, err=err)
            )
            print(f"T={t} {kind} bm={bm} stages={stages} rows={wrows}: {sec * 1e3:.3f} ms, {flops / sec / 1e12:.0f} TFLOP/s, "
                  f"err {err:.1e}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
