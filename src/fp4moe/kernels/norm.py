"""Residual add + zero-centred RMSNorm in one pass, the MoE combine (sum of the k weighted expert outputs +
sigmoid-gated shared expert + residual) followed by the next layer's norm, and the attention heads' q/k norm
with the rotary embedding (``head_norm_rope``). One program per token.
References: ``layers.norm.rms_norm_zero_centred``, ``layers.moe.SparseMoE``, ``layers.rope.Rotary.apply``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4moe.kernels import next_pow2, pdl_args
from fp4moe.kernels.k_order import STEP_K, logical_column
from fp4moe.kernels.tl_helpers import round_bf16, wait_for_previous


@triton.jit
def _norm(h, w_ptr, offs, mask, N, eps):
    var = tl.sum(h * h, 0) / N
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return round_bf16(h * tl.rsqrt(var + eps) * (1.0 + w))


@triton.jit
def _add_norm_kernel(
    h_ptr,
    add_ptr,
    w_ptr,
    h_out_ptr,
    x_out_ptr,
    xk_ptr,
    N,
    eps,
    HAS_ADD: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
    K_ORDER: tl.constexpr = False,
):
    wait_for_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    h = tl.load(h_ptr + t * N + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_ADD:
        h = round_bf16(h + tl.load(add_ptr + t * N + offs, mask=mask, other=0.0).to(tl.float32))
        tl.store(h_out_ptr + t * N + offs, h.to(h_out_ptr.dtype.element_ty), mask=mask)
    x = _norm(h, w_ptr, offs, mask, N, eps)
    tl.store(x_out_ptr + t * N + offs, x.to(x_out_ptr.dtype.element_ty), mask=mask)
    if K_ORDER:  # the same row again in the Hopper expert GEMMs' K order (``k_order``)
        tl.store(xk_ptr + t * N + logical_column(offs), x.to(xk_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(h, add, weight, eps, h_out=None, x_out=None, num_warps: int | None = None, x_k=None):
    """h_out = h + add (skipped when add is None); x_out = rmsnorm(h_out) * (1 + weight). Rows of N. ``x_k``
    (a [rows, N] buffer, N a multiple of 128): x_out written there too, in ``k_order``'s order."""
    if x_k is not None and (x_k.shape != h.shape or h.shape[1] % STEP_K):
        raise ValueError(
            f"a K-order output {tuple(x_k.shape)} for rows {tuple(h.shape)} (N a multiple of {STEP_K})"
        )
    t, n = h.shape
    num_warps = num_warps or (16 if t <= 8 else 8)  # H200 sweep (benchmarks/tune/tune_kernels.py)
    h_out = h if add is None else (torch.empty_like(h) if h_out is None else h_out)
    x_out = torch.empty_like(h) if x_out is None else x_out
    _add_norm_kernel[(t,)](
        h,
        h if add is None else add,
        weight,
        h_out,
        x_out,
        x_out if x_k is None else x_k,
        n,
        eps,
        HAS_ADD=add is not None,
        num_warps=num_warps,
        BLOCK=next_pow2(n),
        K_ORDER=x_k is not None,
        **pdl_args("start"),  # the next projection's GEMV loads its first weight tile meanwhile
    )
    return h_out, x_out


@triton.jit
def _combine_kernel(
    h_ptr, y_ptr, shared_ptr, proj_ptr, stride_p, gate_col, w_ptr, h_out_ptr, x_out_ptr, N, eps,
    TOPK: tl.constexpr, HAS_SHARED: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    routed = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        routed += tl.load(y_ptr + (t * TOPK + j) * N + offs, mask=mask, other=0.0).to(tl.float32)
    mlp = round_bf16(routed)
    if HAS_SHARED:
        g = tl.load(proj_ptr + t * stride_p + gate_col).to(tl.float32)
        s = tl.load(shared_ptr + t * N + offs, mask=mask, other=0.0).to(tl.float32)
        mlp = round_bf16(mlp + round_bf16(round_bf16(tl.sigmoid(g)) * s))
    h = round_bf16(tl.load(h_ptr + t * N + offs, mask=mask, other=0.0).to(tl.float32) + mlp)
    tl.store(h_out_ptr + t * N + offs, h.to(h_out_ptr.dtype.element_ty), mask=mask)
    x = _norm(h, w_ptr, offs, mask, N, eps)
    tl.store(x_out_ptr + t * N + offs, x.to(x_out_ptr.dtype.element_ty), mask=mask)


def moe_combine(
    h,
    y,
    top_k,
    shared,
    proj,
    gate_col,
    next_weight,
    eps,
    h_out=None,
    x_out=None,
    num_warps: int | None = None,
):
    """h_out = h + sum_k y[t*k + j] + sigmoid(proj[t, gate_col]) * shared[t]; x_out = next norm of h_out.
    ``shared`` None: no shared expert. y [T*k, N] (already weighted; bf16 or fp32), summed in fp32."""
    t, n = h.shape
    # H200, in the captured decode step (benchmarks/tune/tune_decode.py): 16 warps 2.4% faster than 4 at batch 1
    num_warps = num_warps or 16
    h_out = torch.empty_like(h) if h_out is None else h_out
    x_out = torch.empty_like(h) if x_out is None else x_out
    has_shared = shared is not None
    _combine_kernel[(t,)](
        h, y, shared if has_shared else h, proj if has_shared else h, proj.stride(0) if has_shared else 0,
        gate_col, next_weight, h_out, x_out, n, eps,
        TOPK=top_k, HAS_SHARED=has_shared, BLOCK=next_pow2(n), num_warps=num_warps,
        **pdl_args("start"),  # the next layer's input projection loads its first tile meanwhile
    )  # fmt: skip
    return h_out, x_out


@triton.jit
def _head_norm_rope_kernel(
    x_ptr, stride_t, stride_h, w_ptr, cos_ptr, sin_ptr, stride_c, out_ptr, H, D, R, eps,
    HB: tl.constexpr, BD: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, HB)
    d = tl.arange(0, BD)
    d_ok = d < D
    mask = (h < H)[:, None] & d_ok[None, :]
    row = x_ptr + t * stride_t + h[:, None] * stride_h
    x = tl.load(row + d[None, :], mask=mask, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, 1) / D + eps)[:, None]
    w = tl.load(w_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
    y = round_bf16(x * r * (1.0 + w)[None, :])
    # rotate-half over the first R dims, at the rotary's roundings: each product to bf16, then their sum;
    # the partner of dim i is i + R/2 (first half, negated) or i - R/2, normed from the same row scale
    rot = d < R
    half = R // 2
    partner = tl.where(d < half, d + half, d - half)
    xp = tl.load(row + partner[None, :], mask=mask & rot[None, :], other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + partner, mask=rot, other=0.0).to(tl.float32)
    yp = round_bf16(xp * r * (1.0 + wp)[None, :])
    c = tl.load(cos_ptr + t * stride_c + d, mask=rot, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + t * stride_c + d, mask=rot, other=0.0).to(tl.float32)[None, :]
    sign = tl.where(d < half, -1.0, 1.0)[None, :]
    y = tl.where(rot[None, :], round_bf16(round_bf16(y * c) + round_bf16(sign * yp * s)), y)
    tl.store(out_ptr + (t * H + h[:, None]) * D + d[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def head_norm_rope_fits(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether ``head_norm_rope`` takes these: unit stride along the last dim of x, cos and sin (sin laid out
    as cos), and an even number of rotary dims R = cos.shape[-1] no more than x's head dim."""
    r = cos.shape[-1]
    return (
        x.stride(-1) == 1
        and cos.stride(-1) == 1
        and sin.stride() == cos.stride()
        and r % 2 == 0
        and r <= x.shape[-1]
    )


def head_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor):
    """x [T, H, D] (unit stride along D; tokens and heads at any stride: q read straight out of q_proj's
    query/gate rows, k out of a fused projection) -> the zero-centred RMSNorm of each head with ``Rotary.apply``
    on its first R = cos.shape[-1] dims, [T, H, D] contiguous in x's dtype. cos/sin [T, R]. One pass where
    the torch path makes ~10 (the q norm's fp32 chain on a strided view, the rotary's products, sums and two
    concatenations)."""
    t, h, d = x.shape
    r = cos.shape[-1]
    if not head_norm_rope_fits(x, cos, sin):
        raise ValueError(
            f"head_norm_rope: x {tuple(x.shape)} and cos/sin {tuple(cos.shape)} need unit stride along their last "
            f"dim and an even number of rotary dims, at most the head's ({r} rotary dims for heads of {d})"
        )
    out = torch.empty(t, h, d, dtype=x.dtype, device=x.device)
    if t:
        _head_norm_rope_kernel[(t,)](
            x, x.stride(0), x.stride(1), weight, cos, sin, cos.stride(0), out, h, d, r, eps,
            HB=next_pow2(h), BD=next_pow2(d), num_warps=4, **pdl_args(),
        )  # fmt: skip
    return out
