"""RMSNorms of qwen3_5_moe, computed in fp32."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def rms_norm_zero_centred(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * (1 + w), in fp32, back to x's dtype (layer, final, q/k norms)."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (out * (1.0 + weight.float())).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """w * rmsnorm(x) * silu(gate) per head (Gated DeltaNet output); plain weight, normalised in fp32."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * normed * F.silu(gate.float())).to(x.dtype)


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm: the weight is stored as an offset from 1."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.dtype == torch.bfloat16 and x.is_contiguous():  # one Triton pass, same roundings
            from fp4moe.kernels.norm import add_rms_norm

            return add_rms_norm(x.view(-1, x.shape[-1]), None, self.weight, self.eps)[1].view_as(x)
        return rms_norm_zero_centred(x, self.weight, self.eps)
