"""Router: fp32 softmax over the experts, top-k, renormalised weights -- one program per token. The same
program applies SiLU(gate) * up of the shared expert, whose projections come out of the same fused GEMM
as the router logits (columns [E, E + 2S) of ``proj``). Reference: ``router_reference`` (the engine's
``SparseMoE.route``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fp4moe.kernels import next_pow2, pdl_args
from fp4moe.kernels.tl_helpers import round_bf16, wait_for_previous


@triton.jit
def _router_kernel(
    proj_ptr,
    stride_p,
    ids_ptr,
    w_ptr,
    shared_ptr,
    E,
    S,
    EP: tl.constexpr,
    TOPK: tl.constexpr,
    KP: tl.constexpr,
    SP: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    t = tl.program_id(0)
    row = proj_ptr + t.to(tl.int64) * stride_p
    offs = tl.arange(0, EP)
    logits = tl.load(row + offs, mask=offs < E, other=float("-inf")).to(tl.float32)
    p = tl.exp(logits - tl.max(logits, 0))
    p = p / tl.sum(p, 0)
    kk = tl.arange(0, KP)
    top_w = tl.zeros((KP,), dtype=tl.float32)
    top_i = tl.zeros((KP,), dtype=tl.int32)
    for j in tl.static_range(TOPK):
        m = tl.max(p, 0)
        # (in range whatever the logits: with a NaN no p equals m, and an id of EP would send the experts'
        # kernels past the last expert)
        idx = tl.minimum(tl.min(tl.where(p == m, offs, EP), 0), E - 1)
        top_w = tl.where(kk == j, m, top_w)
        top_i = tl.where(kk == j, idx, top_i)
        p = tl.where(offs == idx, -1.0, p)
    top_w = top_w / tl.sum(top_w, 0)
    tl.store(ids_ptr + t * TOPK + kk, top_i, mask=kk < TOPK)
    tl.store(w_ptr + t * TOPK + kk, top_w, mask=kk < TOPK)
    if S > 0:
        so = tl.arange(0, SP)
        gate = tl.load(row + E + so, mask=so < S, other=0.0).to(tl.float32)
        up = tl.load(row + E + S + so, mask=so < S, other=0.0).to(tl.float32)
        act = round_bf16(gate * tl.sigmoid(gate))
        tl.store(shared_ptr + t * S + so, round_bf16(act * up).to(shared_ptr.dtype.element_ty), mask=so < S)


def route(
    proj: torch.Tensor,
    num_experts: int,
    top_k: int,
    shared_inter: int = 0,
    out=None,
    num_warps: int | None = None,
    trigger: str = "",
):
    """proj [T, >= E + 2S] -> (topk_ids [T, k] int32, topk_weights [T, k] fp32, shared act [T, S]);
    ``trigger``: when the kernel behind may start (``pdl_args``)."""
    t = proj.shape[0]
    if num_warps is None:  # H200, in the captured decode step (benchmarks/tune/tune_decode.py): one warp per
        # program (shuffle-only reductions) 1.5% faster than 8 warps at batch 1, 0.8% at 16
        num_warps = 1 if t <= 32 else 2
    if out is None:
        dev = proj.device
        out = (
            torch.empty(t, top_k, dtype=torch.int32, device=dev),
            torch.empty(t, top_k, dtype=torch.float32, device=dev),
            torch.empty(t, max(shared_inter, 1), dtype=proj.dtype, device=dev),
        )
    ids, weights, shared = out
    _router_kernel[(t,)](
        proj, proj.stride(0), ids, weights, shared, num_experts, shared_inter,
        EP=next_pow2(num_experts), TOPK=top_k, KP=next_pow2(top_k), SP=next_pow2(max(shared_inter, 1)),
        num_warps=num_warps, **pdl_args(trigger),
    )  # fmt: skip
    return ids, weights, shared


def router_reference(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    return ids, weights / weights.sum(-1, keepdim=True)
