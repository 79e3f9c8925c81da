"""Where an 8K prefill's two biggest costs could go next (issue 4), at the full-size shapes on the GPU:

1. The routed experts: our grouped W4A16 kernels (``moe_gate_up`` + ``moe_down``, dequantizing in
   registers per tile) against dequantizing every expert to bf16 once per layer and running PyTorch's grouped
   GEMM (``torch._grouped_mm``, CUTLASS on sm90) on the pairs sorted by expert. The second matches the CPU
   reference path's numerics (bf16 weights, bf16 GEMMs); its cost is the 1.6 GB of bf16 weights written
   and read back per layer. Both are checked against each other.
2. The chunked gated delta rule (flash-linear-attention) with fp32 inputs, as the engine calls it, against
   bf16 inputs, as transformers' fla path calls it.

    python3 benchmarks/tune/tune_prefill.py --tokens 8192 --out tune-prefill.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, provenance.py
from common import E, H, I, event_seconds, weights  # noqa: E402
from common import K as TOPK  # noqa: E402
from provenance import write_result

from fp4moe.formats import nvfp4
from fp4moe.kernels import moe_routing as mr
from fp4moe.kernels import nvfp4_gemm as gemm
from fp4moe.kernels.tl_helpers import bf16


@triton.jit
def _dequant_kernel(
    p_ptr, s_ptr, d_ptr, out_ptr, N, K, D_PER: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr
):
    """packed [E, N, K/2] + fp8 block scales [E, N, K/16] + decode scales [E, D_PER] -> bf16 [E, N, K] (code *
    (block scale * decode scale), rounded once: ``formats.nvfp4.dequantize_modelopt``)."""
    e = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    d = tl.load(d_ptr + e * D_PER + (n >= N // 2).to(tl.int32) * (D_PER - 1))  # gate / up halves
    for k0 in range(0, K, BK):
        kh = k0 // 2 + tl.arange(0, BK // 2)
        packed = tl.load(p_ptr + e * N * (K // 2) + n[:, None] * (K // 2) + kh[None, :]).to(tl.uint16)
        codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), (BN, BK))
        vals = (((codes & 8) << 12) | ((codes & 7) << 9)).to(tl.float16, bitcast=True).to(
            tl.float32
        ) * 16384.0
        ks = k0 // 16 + tl.arange(0, BK // 16)
        s = tl.load(s_ptr + e * N * (K // 16) + n[:, None] * (K // 16) + ks[None, :])
        scale = s.to(tl.float8e4nv, bitcast=True).to(tl.float32) * d[:, None]
        w = tl.reshape(tl.reshape(vals, (BN, BK // 16, 16)) * scale[:, :, None], (BN, BK))
        k = k0 + tl.arange(0, BK)
        tl.store(out_ptr + e * N * K + n[:, None] * K + k[None, :], bf16(w))  # round to nearest


def dequant(packed, scales, decode) -> torch.Tensor:
    e, n, kh = packed.shape
    out = torch.empty(e, n, 2 * kh, dtype=torch.bfloat16, device=packed.device)
    d_per = decode.shape[-1] if decode.ndim == 2 else 1
    _dequant_kernel[(e, n // 32)](
        packed,
        scales.view(torch.uint8),
        decode.float().contiguous(),
        out,
        n,
        2 * kh,
        D_PER=d_per,
        BN=32,
        BK=128,
    )
    return out


def timed(fn, reps: int = 5) -> float:
    """Median seconds per call after a warm-up call."""
    fn()
    torch.cuda.synchronize()
    return statistics.median(event_seconds(fn, reps))


def experts(t: int, dev) -> dict:
    layer = weights(dev, 1)[0]
    gu, dn = layer["gu"], layer["dn"]
    x = torch.randn(t, H, device=dev, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(E, device=dev)[:TOPK] for _ in range(t)]).int()
    w = torch.rand(t, TOPK, device=dev)
    w = (w / w.sum(-1, keepdim=True)).to(torch.bfloat16)
    flops = 2 * t * TOPK * 3 * H * I
    bm = gemm.block_m(t, TOPK, E)
    routing = mr.align_reference(ids, E, bm)

    def ours():
        act = gemm.moe_gate_up(x, *gu, routing, TOPK)
        return gemm.moe_down(act, *dn, routing, w.float()).view(t, TOPK, H).sum(1, dtype=torch.float32)

    check = dequant(gu[0][:2], gu[1][:2], gu[2][:2])
    ref = torch.cat(
        [
            nvfp4.dequantize_modelopt(gu[0][:2, half], gu[1][:2, half], gu[2][:2, j], torch.bfloat16)
            for j, half in enumerate((slice(0, I), slice(I, 2 * I)))
        ],
        dim=1,
    )
    exact = bool(torch.equal(check, ref))
    order = torch.sort(ids.reshape(-1).long(), stable=True).indices
    offs = torch.cumsum(torch.bincount(ids.reshape(-1).long(), minlength=E), 0).int()
    token = order // TOPK
    w_sorted = w.reshape(-1)[order]
    parts = {}

    def grouped(split: dict | None = None):
        def step(name, fn):
            if split is None:
                return fn()
            out = fn()
            split[name] = timed(fn)
            return out

        w_gu = step("dequant gate/up", lambda: dequant(*gu))
        w_dn = step("dequant down", lambda: dequant(*dn))
        xs = step("gather rows", lambda: x[token])
        g = step("grouped GEMM gate/up", lambda: torch._grouped_mm(xs, w_gu.transpose(1, 2), offs=offs))
        gate, up = g.chunk(2, dim=-1)
        act = step("silu * up", lambda: F.silu(gate) * up)
        y = step("grouped GEMM down", lambda: torch._grouped_mm(act, w_dn.transpose(1, 2), offs=offs))
        return step(
            "weight + sum",
            lambda: torch.zeros(t, H, device=dev).index_add_(0, token, (y * w_sorted[:, None]).float()),
        )

    a, b = ours(), grouped(parts)
    err = float((a - b).norm() / a.norm())
    t_ours, t_grouped = timed(ours), timed(grouped)
    return dict(
        tokens=t, ours_ms=t_ours * 1e3, ours_tflops=flops / t_ours / 1e12, grouped_ms=t_grouped * 1e3,
        grouped_tflops=flops / t_grouped / 1e12, parts_ms={k: v * 1e3 for k, v in parts.items()},
        rel_diff=err, dequant_exact=exact,
    )  # fmt: skip


GATE_UP_TILES = {  # (block rows, Tiles): 128-row blocks halve the dequantization per FLOP
    64: [(64, 128, 4, 3), (128, 64, 8, 3), (64, 64, 4, 4)],
    128: [(64, 128, 8, 3), (64, 64, 8, 4), (128, 64, 8, 3), (32, 128, 4, 3), (64, 128, 4, 3)],
}
DOWN_TILES = {
    64: [(128, 64, 4, 3), (128, 128, 8, 3), (256, 64, 8, 3)],
    128: [(128, 64, 8, 3), (128, 128, 8, 3), (64, 128, 4, 3), (256, 64, 8, 3), (128, 64, 4, 3)],
}


def tiles(t: int, dev) -> list[dict]:
    """The gate/up and down launches alone at ``t`` tokens for each block-row count and launch setting
    (TFLOP/s over each launch's own FLOPs)."""
    layer = weights(dev, 1)[0]
    x = torch.randn(t, H, device=dev, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(E, device=dev)[:TOPK] for _ in range(t)]).int()
    w = torch.rand(t, TOPK, device=dev)
    rows = []
    for bm in GATE_UP_TILES:
        routing = mr.align_reference(ids, E, bm)
        act = gemm.moe_gate_up(x, *layer["gu"], routing, TOPK)
        for kind, cfgs, flops in (
            ("gate_up", GATE_UP_TILES[bm], 2 * t * TOPK * 2 * I * H),
            ("down", DOWN_TILES[bm], 2 * t * TOPK * I * H),
        ):
            for cfg in cfgs:
                tl_ = gemm.Tiles(*cfg)

                def fn(kind=kind, tl_=tl_, routing=routing, act=act):
                    if kind == "gate_up":
                        return gemm.moe_gate_up(x, *layer["gu"], routing, TOPK, tiles=tl_)
                    return gemm.moe_down(act, *layer["dn"], routing, w, tiles=tl_)

                try:
                    s = timed(fn)
                except Exception as exc:  # a setting the compiler refuses (shared memory, registers)
                    print(f"skip {kind} bm={bm} {tl_}: {type(exc).__name__}: {str(exc)[:80]}", flush=True)
                    continue
                rows.append(dict(kind=kind, bm=bm, tiles=repr(tl_), ms=s * 1e3, tflops=flops / s / 1e12))
                print(json.dumps(rows[-1]), flush=True)
    return rows


def delta_rule(t: int, dev) -> dict:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    hk, hv, d = 16, 32, 128
    q = F.normalize(torch.randn(1, t, hk, d, device=dev), dim=-1) * d**-0.5
    k = F.normalize(torch.randn(1, t, hk, d, device=dev), dim=-1)
    v = torch.randn(1, t, hv, d, device=dev)
    g = -torch.rand(1, t, hv, device=dev) * 0.1
    beta = torch.rand(1, t, hv, device=dev)
    state = torch.zeros(1, hv, d, d, device=dev)
    out = {}
    for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):

        def run(dt=dt):
            return chunk_gated_delta_rule(
                q.to(dt), k.to(dt), v.to(dt), g, beta.to(dt), scale=1.0, initial_state=state,
                output_final_state=True,
            )  # fmt: skip

        out[f"{name}_ms"] = timed(run) * 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192, help="prefill tokens per launch (default 8192)")
    ap.add_argument("--out", default="", help="write the results to this JSON file")
    ap.add_argument("--tiles", action="store_true", help="only sweep the expert launches' tile settings")
    args = ap.parse_args()
    dev = torch.device("cuda")
    if args.tiles:
        res = dict(device=torch.cuda.get_device_name(), tiles=tiles(args.tokens, dev))
        if args.out:
            write_result(args.out, res, indent=1)
        return
    res = dict(device=torch.cuda.get_device_name(), experts=experts(args.tokens, dev))
    print(json.dumps(res["experts"], indent=1), flush=True)
    try:
        res["delta_rule"] = delta_rule(args.tokens, dev)
        print(json.dumps(res["delta_rule"]), flush=True)
    except ImportError as exc:
        print(f"no fla: {exc}")
    if args.out:
        write_result(args.out, res, indent=1)


if __name__ == "__main__":
    main()
