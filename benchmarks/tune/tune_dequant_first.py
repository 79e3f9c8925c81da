# ruff: noqa: B023  (each closure is called inside the loop iteration that defines it)
"""Dequantize first, then a bf16 grouped GEMM, for prefill experts? (issue 22: the experts are 40% of an 8K
prefill). Per layer: every expert's NVFP4 weights to bf16 (value x block scale, exact; the decode scale stays on
the accumulator) by a bandwidth-bound kernel below, then ``nvfp4_gemm``'s row kernel on the bf16 weights
(mode 0, operands from shared memory) -- against the weights-first kernel that dequantizes each tile in
registers for every row block. Also torch's grouped GEMM (``torch._grouped_mm``, CUTLASS) on the same bf16
weights, no epilogue, for scale. Full-size experts (hidden 2048, 256 experts top-8, I = 512), random routing,
each launch over LAYERS layers in one CUDA graph, median of replays; outputs checked against the default path.

    python3 benchmarks/tune/tune_dequant_first.py --tokens 8192 16384 4096 --out tune-dequant-first.json

Result on the H200 (2026-12-03): no gain at 8,192 tokens (the step budget): dequantizing costs what the
bf16 GEMM saves (BENCHMARKS.md). The kernel is kept here, not in the package.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, provenance.py
from common import E, H, I, K, event_seconds, graph_time, log, weights  # noqa: E402
from provenance import write_result

from fp4moe.kernels import moe_routing as mr
from fp4moe.kernels import nvfp4_gemm as gemm
from fp4moe.kernels.nvfp4_dequant import block_k, dequant_bf16

LAYERS = 4
CANDIDATES = (
    (128, 64, 8, 3),
    (128, 64, 4, 4),
    (256, 64, 8, 3),
    (128, 128, 8, 2),
    (64, 64, 4, 4),
    (128, 64, 8, 4),
)


@triton.jit
def _dequantize_kernel(w_ptr, s_ptr, out_ptr, ROWS, K, BN: tl.constexpr, BK: tl.constexpr):
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    k0 = tl.program_id(1) * BK
    rows = n.to(tl.int64)[:, None]
    mask = n[:, None] < ROWS
    w = dequant_bf16(
        w_ptr + rows * (K // 2) + (k0 // 2 + tl.arange(0, BK // 2))[None, :],
        s_ptr + rows * (K // 16) + (k0 // 16 + tl.arange(0, BK // 16))[None, :],
        mask, mask, BN, BK,
    )  # fmt: skip
    tl.store(out_ptr + rows * K + (k0 + tl.arange(0, BK))[None, :], w, mask=mask)


def dequantize(packed: torch.Tensor, scales: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Packed codes [..., N, K/2] and FP8 block scales [..., N, K/16] -> bf16 [..., N, K] (value x scale)."""
    k = packed.shape[-1] * 2
    if out is None:
        out = torch.empty(*packed.shape[:-1], k, dtype=torch.bfloat16, device=packed.device)
    rows, bk = packed.numel() * 2 // k, block_k(k)
    _dequantize_kernel[(triton.cdiv(rows, 64), k // bk)](
        packed, scales.view(torch.uint8), out, rows, k, BN=64, BK=bk
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384, 4096], help="tokens per launch")
    ap.add_argument("--out", default="", help="write every timing to this JSON file")
    args = ap.parse_args()
    dev = torch.device("cuda")
    ws = weights(dev, LAYERS)
    gu_bf = [dequantize(w["gu"][0], w["gu"][1]) for w in ws]
    dn_bf = [dequantize(w["dn"][0], w["dn"][1]) for w in ws]
    buf_gu, buf_dn = torch.empty_like(gu_bf[0]), torch.empty_like(dn_bf[0])
    res = dict(device=torch.cuda.get_device_name(), rows=[])
    res["dequant_ms"] = dict(
        gu=graph_time(lambda: [dequantize(*w["gu"][:2], out=buf_gu) for w in ws], 15, LAYERS) * 1e3,
        dn=graph_time(lambda: [dequantize(*w["dn"][:2], out=buf_dn) for w in ws], 15, LAYERS) * 1e3,
    )
    log(
        f"dequantize one layer: gate/up {res['dequant_ms']['gu']:.3f} ms, down {res['dequant_ms']['dn']:.3f} ms"
    )
    for t in args.tokens:
        gen = torch.Generator(device=dev).manual_seed(t)
        x = torch.randn(t, H, device=dev, dtype=torch.bfloat16)
        ids = [
            torch.rand(t, E, device=dev, generator=gen).topk(K, dim=1).indices.int() for _ in range(LAYERS)
        ]
        topw = torch.rand(t, K, device=dev)
        r128 = [mr.align(i, E, 128) for i in ids]
        ref_act = gemm.moe_gate_up(x, *ws[0]["gu"], r128[0], K)
        ref_y = gemm.moe_down(ref_act, *ws[0]["dn"], r128[0], topw)
        act = torch.empty(t * K, I, dtype=torch.bfloat16, device=dev)
        y = torch.empty(t * K, H, dtype=torch.bfloat16, device=dev)
        base_gu = graph_time(lambda: [gemm.moe_gate_up(x, *w["gu"], r, K, out=act) for w, r in zip(ws, r128, strict=True)], 15, LAYERS)  # fmt: skip
        base_dn = graph_time(lambda: [gemm.moe_down(ref_act, *w["dn"], r, topw, out=y) for w, r in zip(ws, r128, strict=True)], 15, LAYERS)  # fmt: skip
        row = dict(tokens=t, default_ms=dict(gu=base_gu * 1e3, dn=base_dn * 1e3), bf16=[])
        log(f"T={t} default (weights-first): gate/up {base_gu * 1e3:.3f} ms, down {base_dn * 1e3:.3f} ms")
        fl_gu, fl_dn = 4 * t * K * I * H, 2 * t * K * H * I
        for bm in (128, 64):
            rs = [mr.align(i, E, bm) for i in ids]
            for kind in ("gu", "dn"):
                for bn, bk, warps, stages in CANDIDATES:
                    tiles = gemm.Tiles(bn, bk, warps, stages)
                    try:
                        if kind == "gu":
                            sec = graph_time(lambda: [gemm.moe_gate_up(x, gb, w["gu"][1], w["gu"][2], r, K, out=act, tiles=tiles)
                                                      for w, gb, r in zip(ws, gu_bf, rs, strict=True)], 15, LAYERS)  # fmt: skip
                            got = gemm.moe_gate_up(
                                x, gu_bf[0], ws[0]["gu"][1], ws[0]["gu"][2], rs[0], K, tiles=tiles
                            )
                            ref, fl = ref_act, fl_gu
                        else:
                            sec = graph_time(lambda: [gemm.moe_down(ref_act, db, w["dn"][1], w["dn"][2], r, topw, out=y, tiles=tiles)
                                                      for w, db, r in zip(ws, dn_bf, rs, strict=True)], 15, LAYERS)  # fmt: skip
                            got = gemm.moe_down(
                                ref_act, dn_bf[0], ws[0]["dn"][1], ws[0]["dn"][2], rs[0], topw, tiles=tiles
                            )
                            ref, fl = ref_y, fl_dn
                    except triton.runtime.errors.OutOfResources as e:
                        log(f"  {kind} bm={bm} {tiles}: {e}")
                        continue
                    err = float((got.float() - ref.float()).abs().max() / ref.float().abs().max())
                    row["bf16"].append(dict(kind=kind, block=bm, tiles=repr(tiles), ms=sec * 1e3, tflops=fl / sec / 1e12, err=err))  # fmt: skip
                    log(
                        f"  bf16 {kind} bm={bm} {tiles}: {sec * 1e3:.3f} ms, {fl / sec / 1e12:.0f} TFLOP/s, err {err:.1e}"
                    )
        if hasattr(torch, "_grouped_mm"):  # CUTLASS's grouped GEMM, rows sorted by expert, no epilogue
            ids0 = ids[0].reshape(-1)
            order = torch.argsort(ids0, stable=True)
            offs = torch.cumsum(torch.bincount(ids0, minlength=E), 0).to(torch.int32)
            a_sorted, a2 = x[order // K].contiguous(), torch.randn(t * K, I, device=dev, dtype=torch.bfloat16)
            wgu, wdn = gu_bf[0].transpose(1, 2), dn_bf[0].transpose(1, 2)
            row["grouped_mm_ms"] = {
                name: statistics.median(event_seconds(fn, 20)) * 1e3
                for name, fn in (
                    ("gu", lambda: torch._grouped_mm(a_sorted, wgu, offs=offs)),
                    ("dn", lambda: torch._grouped_mm(a2, wdn, offs=offs)),
                    ("gather", lambda: x[order // K]),
                )
            }
            log(f"  torch._grouped_mm: {row['grouped_mm_ms']}")
        res["rows"].append(row)
        if args.out:
            write_result(args.out, res, indent=1)


if __name__ == "__main__":
    main()
