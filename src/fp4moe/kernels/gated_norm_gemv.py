"""The Gated DeltaNet's output at decode, fused: the gated RMSNorm of each value head applied as the out_proj
GEMV reads its input, so a decode step's 1-4 rows need no launch of their own for the norm.

y = out_proj(w * rmsnorm(o) * silu(z)) per head of Dv values: each program (row, block of BN outputs) walks
K in tiles of whole heads, norms each head of the tile in registers (every program recomputes the norms of
the row it reads: a row is 4096 values, the weight it multiplies 2048 x 4096) and multiplies. Roundings as
``gdn_decode.gated_norm`` then the dense GEMV: the normed value, w * normed and the product with silu(z) are
bf16 on the way, the output is rounded once from fp32 sums. The weight tile is loaded before the wait for
the kernel ahead (the Gated DeltaNet kernel), as the other GEMVs do. Reference: ``gated_norm_gemv_reference``
(``layers.norm.gated_rms_norm`` then the matrix product)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4moe.kernels import pdl_args
from fp4moe.kernels.tl_helpers import round_bf16, wait_for_previous

MAX_ROWS = 4  # past this the weight read once per row costs more than the norm's own launch


@triton.jit
def _normed_tile(o_row, z_row, norm_w, k0, eps, DV: tl.constexpr, BK: tl.constexpr):
    """Input tile [BK] (BK / DV whole heads from k0): bf16(bf16(w * bf16(o / rms(o))) * silu(z)), fp32."""
    offs = k0 + tl.arange(0, BK)
    o = tl.reshape(tl.load(o_row + offs).to(tl.float32), (BK // DV, DV))
    z = tl.reshape(tl.load(z_row + offs).to(tl.float32), (BK // DV, DV))
    normed = round_bf16(o * tl.rsqrt(tl.sum(o * o, 1) / DV + eps)[:, None])
    y = round_bf16(norm_w[None, :] * normed) * (z * tl.sigmoid(z))
    return tl.reshape(round_bf16(y), (BK,))


@triton.jit
def _gated_norm_gemv_kernel(
    o_ptr, stride_o, z_ptr, stride_z, nw_ptr, w_ptr, stride_wn, out_ptr, stride_out, N, K, eps,
    DV: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SUM_EACH: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    p = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BK)
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    mask_w = mask_n[:, None] & (offs_k >= 0)[None, :]
    w = tl.load(w_rows + offs_k[None, :], mask=mask_w, other=0.0)  # before the wait: nothing writes it
    norm_w = tl.load(nw_ptr + tl.arange(0, DV)).to(tl.float32)
    wait_for_previous(PDL)
    o_row, z_row = o_ptr + p * stride_o, z_ptr + p * stride_z
    acc = tl.zeros((BN, 1 if SUM_EACH else BK), dtype=tl.float32)
    for k0 in range(0, K, BK):
        if k0 > 0:
            w = tl.load(w_rows + (k0 + offs_k)[None, :], mask=mask_w, other=0.0)
        prod = w.to(tl.float32) * _normed_tile(o_row, z_row, norm_w, k0, eps, DV, BK)[None, :]
        acc = acc + tl.sum(prod, 1, keep_dims=True) if SUM_EACH else acc + prod
    y = tl.sum(acc, 1)
    tl.store(out_ptr + p * stride_out + offs_n, round_bf16(y).to(out_ptr.dtype.element_ty), mask=mask_n)


def fits(o: torch.Tensor, weight: torch.Tensor, head_dim: int) -> bool:
    """Whether ``gated_norm_gemv`` takes these rows: on the GPU, 1-``MAX_ROWS`` bf16 rows, a bf16 weight whose
    K (the heads' values, contiguous) the tiles of whole heads divide."""
    return (
        o.is_cuda
        and o.dim() == 2
        and 1 <= o.shape[0] <= MAX_ROWS
        and o.dtype == weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and weight.shape[1] == o.shape[1]
        and weight.stride(1) == 1
        and o.stride(1) == 1
        and head_dim & (head_dim - 1) == 0
        and o.shape[1] % head_dim == 0
    )


def gated_norm_gemv(
    o: torch.Tensor, z: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor, out=None
) -> torch.Tensor:
    """o [M, H*Dv] (a Gated DeltaNet's readout before its norm), z [M, H*Dv] (rows may be strided: a view of
    the projection), norm_weight [Dv], weight [N, H*Dv] bf16 -> out_proj(gated_rms_norm(o, z)) [M, N] bf16."""
    m, k = o.shape
    n, dv = weight.shape[0], norm_weight.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=o.dtype, device=o.device)
    # H200 (benchmarks/tune_dense.py --kernels gemv, the plain dense GEMV at out_proj's 2048 x 4096): one row
    # BN 4 / BK 1024 / 8 warps summing each tile, 2-4 rows BN 8 / BK 512 / 4 warps
    bn, bk, warps, sum_each = (4, 1024, 8, True) if m == 1 else (8, 512, 4, False)
    bk = max(bk, dv)
    while bk > dv and k % bk:
        bk //= 2
    if k % bk or dv & (dv - 1):
        raise ValueError(f"{k} inputs in heads of {dv}: the K tiles are whole heads, a power of two")
    _gated_norm_gemv_kernel[(m, triton.cdiv(n, bn))](
        o, o.stride(0), z, z.stride(0), norm_weight, weight, weight.stride(0), out, out.stride(0), n, k, eps,
        DV=dv, BN=bn, BK=bk, SUM_EACH=sum_each, num_warps=warps, num_stages=3, **pdl_args(),
    )  # fmt: skip
    return out


def gated_norm_gemv_reference(o, z, norm_weight, eps, weight) -> torch.Tensor:
    """``gated_norm_gemv`` in torch: the layer's gated RMSNorm, then the bf16 matrix product."""
    from fp4moe.layers.norm import gated_rms_norm

    dv = norm_weight.shape[0]
    normed = gated_rms_norm(o.view(-1, dv), z.reshape(-1, dv), norm_weight, eps).view(o.shape)
    return torch.nn.functional.linear(normed, weight)
