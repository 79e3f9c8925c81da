# ruff: noqa: B023  (each closure is called inside the loop iteration that defines it)
"""Launch settings of the NVFP4 expert GEMMs for decode, timed the way the engine runs them: one CUDA graph
of 40 layers' launches (each layer its own experts and its own random routing, so nothing is served from
L2 that a real step would read from memory), median over replays, per launch.

Full-size shapes: hidden 2048, 256 experts top-8 with I = 512. For each token count T (1: batch-1 decode;
3: a batch-1 speculative verification with k = 2; 16, 64: batched decode), each NVFP4 dequantization mode
and each gate/up K split (0 = silu(gate) * up fused in the launch, s >= 1 = fp32 partial sums of s K ranges,
activation in the down launch) it times a short list of launch settings (BN, BK, warps, stages) for the
gate/up and the down launch, then prints the best pair per T and the bytes they move against the copy
bandwidth.

    python3 benchmarks/tune/tune_experts.py --out tune-experts.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, provenance.py
from common import DN_BYTES, GU_BYTES, LAYERS, E, H, I, K, graph_time, weights  # noqa: E402
from provenance import write_result

from fp4moe.kernels import moe_routing as mr
from fp4moe.kernels import nvfp4_dequant as dq
from fp4moe.kernels import nvfp4_gemm as gemm
from fp4moe.kernels import nvfp4_gemv as gemv


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1,3,16,64", help="token counts per launch to tune for")
    ap.add_argument("--splits", default="0", help="gate/up K splits to try (0: fused activation)")
    ap.add_argument("--modes", default="4,7", help="NVFP4 dequantization modes to try (dq.DEQUANT_MODE)")
    ap.add_argument(
        "--kernels",
        default="mma,gemv",
        help="which expert kernels to sweep: mma (grouped GEMM), gemv (per pair), tcgemv (tensor-core GEMV, "
        "blocks of up to 8 tokens of an expert)",
    )
    ap.add_argument(
        "--tiled",
        action="store_true",
        help="tcgemv: also time the same launches on tile_experts' weight layout",
    )
    ap.add_argument("--budget", type=float, default=330, help="seconds of sweeping before it stops early")
    ap.add_argument("--out", default="", help="write every timing to this JSON file")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    t_start = time.time()
    layers = weights(dev)
    splits = [int(s) for s in args.splits.split(",")]
    modes = [int(m) for m in args.modes.split(",")]
    default_mode = dq.DEQUANT_MODE
    kinds = args.kernels.split(",")
    results = dict(
        device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", rows=[], best={}, best_gemv={}
    )
    for t in [int(x) for x in args.tokens.split(",")]:
        gen = torch.Generator(device=dev).manual_seed(t)
        x = torch.randn(t, H, device=dev, dtype=torch.bfloat16)
        ids = [
            torch.stack([torch.randperm(E, device=dev, generator=gen)[:K] for _ in range(t)]).int()
            for _ in range(LAYERS)
        ]
        w = torch.rand(t, K, device=dev)
        bm = gemm.block_m(t, K, E)
        routes = [mr.align(i, E, bm) for i in ids]
        distinct = statistics.mean(i.unique().numel() for i in ids)
        gu_bytes, dn_bytes = distinct * GU_BYTES, distinct * DN_BYTES
        inputs = {}  # split -> the down launch's input (bf16 act or fp32 partials)
        # the sweep's order: for each dequantization mode and split, gate/up launch settings, then down

        def gate_up(tiles):
            out = inputs.setdefault(("gu", tiles.split), None)

            def fn():
                for lay, r in zip(layers, routes, strict=True):
                    gemm.moe_gate_up(x, *lay["gu"], r, K, out=out, tiles=tiles)

            if out is None:
                inputs[("gu", tiles.split)] = gemm.moe_gate_up(x, *layers[0]["gu"], routes[0], K, tiles=tiles)
                return gate_up(tiles)
            return graph_time(fn)

        def down(tiles, split):
            act = inputs[("gu", split)]
            out = torch.empty(t * K, H, device=dev, dtype=torch.bfloat16)

            def fn():
                for lay, r in zip(layers, routes, strict=True):
                    gemm.moe_down(act, *lay["dn"], r, w, out=out, tiles=tiles)

            return graph_time(fn)

        def sweep(kind, configs, timer):
            found = []
            for cfg in configs:
                if time.time() - t_start > args.budget:
                    print(f"budget spent: {kind} T={t} stops early", flush=True)
                    break
                try:
                    s = timer(cfg)
                except Exception as exc:  # a config the compiler or the tile rules refuse
                    print(f"skip {kind} T={t} {cfg}: {type(exc).__name__}: {str(exc)[:80]}", flush=True)
                    continue
                nbytes = gu_bytes if "gate_up" in kind else dn_bytes
                row = dict(kind=kind, tokens=t, cfg=repr(cfg), us=s * 1e6, gbs=nbytes / s / 1e9)
                results["rows"].append(row)
                found.append((s, cfg))
            return sorted(found, key=lambda r: r[0])

        def keep_best(key, label, rg, rd):
            """results[key][t]: the fastest gate/up and down settings of two sweeps, and their sum."""
            if rg and rd:
                (sg, cg), (sd, cd) = rg[0], rd[0]
                results.setdefault(key, {})[t] = dict(
                    gate_up=repr(cg), down=repr(cd), us=(sg + sd) * 1e6, gate_up_us=sg * 1e6, down_us=sd * 1e6,
                    gbs=(gu_bytes + dn_bytes) / (sg + sd) / 1e9,
                )  # fmt: skip
                print(f"\nT={t} {label}: {json.dumps(results[key][t])}", flush=True)

        if "gemv" in kinds:  # the per-pair GEMVs (ids are the router's, no routing tables)
            act_gemv = gemv.gemv_gate_up(x, *layers[0]["gu"], ids[0])
            out_gemv = torch.empty(t * K, H, device=dev, dtype=torch.bfloat16)

            def gemv_gate_up(cfg):
                return graph_time(lambda: [
                    gemv.gemv_gate_up(x, *lay["gu"], i, out=act_gemv, tiles=cfg)
                    for lay, i in zip(layers, ids, strict=True)
                ])  # fmt: skip

            def gemv_down(cfg):
                return graph_time(lambda: [
                    gemv.gemv_down(act_gemv, *lay["dn"], i, w, out=out_gemv, tiles=cfg)
                    for lay, i in zip(layers, ids, strict=True)
                ])  # fmt: skip

            grid = [gemv.GemvTiles(*c) for c in itertools.product((8, 16), (256, 512), (2, 4), (3,))] + [
                gemv.GemvTiles(bn, bk, wa, 3, sum_each=True)
                for bn, bk, wa in itertools.product((4, 8, 16), (512, 1024, 2048), (4, 8))
            ]
            rg = sweep("gemv gate_up", grid, gemv_gate_up)
            rd = sweep("gemv down", grid, gemv_down)
            keep_best("best_gemv", "GEMV", rg, rd)
        if "tcgemv" in kinds:  # the tensor-core GEMVs (nvfp4_mma_gemv): pairs at T <= 4, blocks of 8 beyond
            from fp4moe.kernels import nvfp4_mma_gemv as mma

            blocks = [
                mr.pair_routing(i, 1) if t <= mr.PAIR_ROUTING_MAX_TOKENS else mr.align(i, E, mma.TOKENS)
                for i in ids
            ]
            act_tc = torch.empty(t * K, I, device=dev, dtype=torch.bfloat16)
            out_tc = torch.empty(t * K, H, device=dev, dtype=torch.bfloat16)

            def tc_gate_up(cfg):
                return graph_time(lambda: [
                    mma.mma_gate_up(x, *lay["gu"], r, K, out=act_tc, tiles=cfg)
                    for lay, r in zip(layers, blocks, strict=True)
                ])  # fmt: skip

            def tc_down(cfg):
                return graph_time(lambda: [
                    mma.mma_down(act_tc, *lay["dn"], r, w, out=out_tc, tiles=cfg)
                    for lay, r in zip(layers, blocks, strict=True)
                ])  # fmt: skip

            grid = [mma.MmaTiles(wk, kc) for wk, kc in ((1, 64), (2, 32), (2, 64), (4, 32), (4, 64), (8, 32))]
            rg = sweep("tcgemv gate_up", grid, tc_gate_up)
            grid = [
                mma.MmaTiles(wk, kc, rows)
                for wk, kc in ((1, 64), (2, 32), (4, 32), (2, 64))
                for rows in (16, 32)
            ]
            rd = sweep("tcgemv down", grid, tc_down)
            keep_best("best_tcgemv", "tensor-core GEMV", rg, rd)
            if (
                args.tiled
            ):  # the same kernel on ``expert_layout``'s tile order (the GPU engine's) at 64-byte steps
                from fp4moe.kernels import expert_layout as el

                step = 64
                tiled = [el.tile_experts(*lay["gu"][:2], step, True) for lay in layers]
                ref = mma.mma_gate_up(x, *layers[0]["gu"], blocks[0], K, tiles=mma.tiles_for(step, True))
                got = mma.mma_gate_up(x, *tiled[0], layers[0]["gu"][2], blocks[0], K, tile=step)
                assert torch.equal(ref, got), "tiled gate/up differs"
                sweep("tcgemv gate_up tiled", [mma.tiles_for(step, True)], lambda c: graph_time(lambda: [
                    mma.mma_gate_up(x, *tl, lay["gu"][2], r, K, out=act_tc, tiles=c, tile=step)
                    for lay, tl, r in zip(layers, tiled, blocks, strict=True)
                ]))  # fmt: skip
                tiled = [el.tile_experts(*lay["dn"][:2], step, False) for lay in layers]
                ref = mma.mma_down(act_tc, *layers[0]["dn"], blocks[0], w, tiles=mma.tiles_for(step, False))
                assert torch.equal(
                    ref, mma.mma_down(act_tc, *tiled[0], layers[0]["dn"][2], blocks[0], w, tile=step)
                )
                sweep("tcgemv down tiled", [mma.tiles_for(step, False)], lambda c: graph_time(lambda: [
                    mma.mma_down(act_tc, *tl, lay["dn"][2], r, w, out=out_tc, tiles=c, tile=step)
                    for lay, tl, r in zip(layers, tiled, blocks, strict=True)
                ]))  # fmt: skip
                del tiled
        best_gu, best_dn = {}, {}
        for mode, split in itertools.product(modes if "mma" in kinds else [], splits):
            dq.DEQUANT_MODE = mode
            key = (mode, split)
            gu_cfgs = [
                gemm.Tiles(bn, bk, wa, st, split)
                for bn, bk, wa, st in itertools.product((32, 64, 128), (128, 256), (4, 8), (2, 3))
                if not (split and (H // split) % bk)
            ]
            ranked = sweep(f"gate_up mode {mode}", gu_cfgs, gate_up)
            if not ranked:
                continue
            best_gu[key] = ranked[0]
            dn_cfgs = [
                gemm.Tiles(bn, 128, wa, st) for bn, wa, st in itertools.product((32, 64, 128), (2, 4), (2, 3))
            ]
            ranked = sweep(f"down mode {mode}", dn_cfgs, lambda c, split=split: down(c, split))
            if ranked:
                best_dn[key] = ranked[0]
        dq.DEQUANT_MODE = default_mode
        print(f"\nT={t} (block rows {bm}, {distinct:.1f} distinct experts per layer):", flush=True)
        pairs = []
        for key in best_dn:
            (sg, cg), (sd, cd) = best_gu[key], best_dn[key]
            total = sg + sd
            pairs.append((total, key))
            print(
                f"  mode {key[0]} split {key[1]}: gate_up {sg * 1e6:6.1f} us ({gu_bytes / sg / 1e9:5.0f} GB/s) {cg}\n"
                f"           down    {sd * 1e6:6.1f} us ({dn_bytes / sd / 1e9:5.0f} GB/s) {cd}\n"
                f"           both    {total * 1e6:6.1f} us = {(gu_bytes + dn_bytes) / total / 1e9:5.0f} GB/s",
                flush=True,
            )
        if pairs:
            total, key = min(pairs)
            results["best"][t] = dict(
                mode=key[0], split=key[1], gate_up=repr(best_gu[key][1]), down=repr(best_dn[key][1]),
                us=total * 1e6, gate_up_us=best_gu[key][0] * 1e6, down_us=best_dn[key][0] * 1e6,
                gbs=(gu_bytes + dn_bytes) / total / 1e9,
            )  # fmt: skip
    if args.out:
        write_result(args.out, results, indent=1)
    print("\nbest per token count:")
    for t, b in results["best"].items():
        print(
            f"  T={t}: {b['us']:.1f} us/layer, {b['gbs']:.0f} GB/s, split {b['split']}: {b['gate_up']} + {b['down']}"
        )


if __name__ == "__main__":
    main()
