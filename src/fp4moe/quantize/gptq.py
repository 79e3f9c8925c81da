"""GPTQ-style error compensation for NVFP4 (``fp4moe quantize --gptq``), batched over experts.

For a weight W [N, K] whose inputs x have second moment H = sum x xᵀ [K, K], GPTQ quantizes the columns in
order and spreads each column's rounding error over the columns not yet quantized, weighted by the inverse
Hessian, so the layer *output* error ||X Wᵀ − X Qᵀ|| shrinks rather than the weight error. The NVFP4 twist:
each group of 16 columns gets its e4m3 block scales (by the chosen scale method: rtn, 4over6, mse) from the
weights as they stand when the group is reached -- i.e. after the error of earlier groups was folded in --
under the fixed global scale. Columns whose input never varied (zero diagonal) are dropped as in GPTQ; an
expert that saw no calibration token gets H = I, which reduces exactly to the plain method (no error moves).

Memory: one [E, K, K] fp32 Hessian per expert input (at full size 256 × 2048² × 4 B = 4.3 GB for gate/up
plus 0.27 GB for down, per layer), freed after the layer.
"""

from __future__ import annotations

import torch

from fp4moe.formats import nvfp4
from fp4moe.quantize.scales import ScaleMethod, choose_block_scales

BLOCK_COLUMNS = 128  # lazy-update width (GPTQ's "block"): a multiple of the 16-column NVFP4 group


@torch.no_grad()
def gptq_quantize(
    w: torch.Tensor,
    hessian: torch.Tensor,
    global_scale: torch.Tensor,
    method: ScaleMethod = ScaleMethod.MSE,
    damp: float = 0.01,
) -> nvfp4.NVFP4Tensor:
    """NVFP4 of ``w`` [..., N, K] under ``global_scale`` [...], compensating with ``hessian`` [..., K, K]."""
    *lead, n, k = w.shape
    if k % nvfp4.BLOCK_SIZE:
        raise ValueError(f"input dimension {k} is not a multiple of {nvfp4.BLOCK_SIZE}")
    W = w.float().reshape(-1, n, k).clone()
    H = hessian.double().reshape(-1, k, k).clone()
    gs = global_scale.float().reshape(-1)
    diag = H.diagonal(dim1=-2, dim2=-1)
    dead = diag == 0
    diag[dead] = 1.0
    W.masked_fill_(dead[:, None, :], 0.0)
    diag += damp * diag.mean(-1, keepdim=True)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True).float()
    codes = torch.zeros(W.shape, dtype=torch.uint8, device=w.device)
    scales = torch.empty(W.shape[0], n, k // nvfp4.BLOCK_SIZE, dtype=nvfp4.FP8_DTYPE, device=w.device)
    for b0 in range(0, k, BLOCK_COLUMNS):
        b1 = min(b0 + BLOCK_COLUMNS, k)
        W1, Hinv1 = W[:, :, b0:b1].clone(), Hinv[:, b0:b1, b0:b1]
        Err1 = torch.zeros_like(W1)
        for g0 in range(0, b1 - b0, nvfp4.BLOCK_SIZE):
            g1 = g0 + nvfp4.BLOCK_SIZE
            sc = choose_block_scales(W1[:, :, g0:g1], gs, method)  # [B, N, 1] from the updated weights
            scales[:, :, (b0 + g0) // nvfp4.BLOCK_SIZE] = sc[..., 0]
            eff = sc.float() / gs[:, None, None]  # [B, N, 1]
            for i in range(g0, g1):
                col = W1[:, :, i : i + 1]
                c = nvfp4.e2m1_codes(torch.clamp(col / eff, -nvfp4.FP4_MAX, nvfp4.FP4_MAX))
                codes[:, :, b0 + i] = c[..., 0]
                q = nvfp4.e2m1_values(c) * eff
                err = (col - q) / Hinv1[:, i, i][:, None, None]  # [B, N, 1]
                W1[:, :, i:] -= err * Hinv1[:, i : i + 1, i:]
                Err1[:, :, i] = err[..., 0]
        W[:, :, b1:] -= Err1 @ Hinv[:, b0:b1, b1:]
    packed = nvfp4.pack_fp4(codes)
    return nvfp4.NVFP4Tensor(
        packed.reshape(*lead, n, k // 2), scales.reshape(*lead, n, -1), global_scale.float().clone()
    )


def hessian_or_identity(hessian: torch.Tensor, num_tokens: torch.Tensor) -> torch.Tensor:
    """[E, K, K] with experts that saw no token set to the identity (GPTQ then equals the plain method)."""
    eye = torch.eye(hessian.shape[-1], dtype=hessian.dtype, device=hessian.device)
    return torch.where((num_tokens == 0).to(hessian.device)[:, None, None], eye, hessian)
