"""Linear layers whose weight is either dense (bf16/fp32) or NVFP4 (packed codes + scales, kept packed).

The CPU path dequantizes NVFP4 / FP8 with the torch reference (fp4moe.formats.nvfp4) at each call; on CUDA
the W4A16 / W8A16 kernels (fp4moe.kernels.nvfp4_gemm) dequantize in registers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fp4moe.formats import fp8, nvfp4


class NVFP4Weight(nn.Module):
    """One [N, K] NVFP4 weight: ``packed`` uint8 [N, K/2], ``block_scales`` e4m3 [N, K/16], ``decode_scale``
    f32 0-D (ModelOpt's weight_scale_2 = 1/compressed-tensors' weight_global_scale)."""

    def __init__(self, out_features: int, in_features: int):
        super().__init__()
        self.out_features, self.in_features = out_features, in_features
        self.register_buffer("packed", torch.empty(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer(
            "block_scales", torch.empty(out_features, in_features // 16, dtype=nvfp4.FP8_DTYPE)
        )
        self.register_buffer("decode_scale", torch.empty((), dtype=torch.float32))

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return nvfp4.dequantize_modelopt(self.packed, self.block_scales, self.decode_scale, dtype)


class FP8Weight(nn.Module):
    """One [N, K] per-tensor FP8 weight: e4m3 ``weight`` and an fp32 ``scale`` (run weight-only here)."""

    def __init__(self, out_features: int, in_features: int):
        super().__init__()
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn))
        self.register_buffer("scale", torch.empty((), dtype=torch.float32))

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return fp8.decode(self.weight, self.scale, dtype)


class Linear(nn.Module):
    """y = x W^T with W dense or NVFP4 (set by the loader through ``quantize_as_nvfp4``)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.nvfp4: NVFP4Weight | None = None
        self.fp8: FP8Weight | None = None

    def use_nvfp4(self) -> None:
        """Replace the dense weight by an NVFP4 one (before loading)."""
        del self.weight
        self.weight = None
        self.nvfp4 = NVFP4Weight(self.out_features, self.in_features)

    def use_fp8(self) -> None:
        """Replace the dense weight by a per-tensor FP8 one (before loading)."""
        del self.weight
        self.weight = None
        self.fp8 = FP8Weight(self.out_features, self.in_features)

    def rows(self, ids: torch.Tensor) -> Linear:
        """A Linear of the output rows ``ids`` alone, in the same format (its tensors copied)."""
        with torch.device("meta"):
            out = Linear(self.in_features, len(ids))
        if self.nvfp4 is not None:  # block scales are per row; the decode scale is the whole matrix's
            out.use_nvfp4()
            q, r = self.nvfp4, out.nvfp4
            r.packed, r.block_scales, r.decode_scale = (
                q.packed[ids],
                q.block_scales[ids],
                q.decode_scale.clone(),
            )
        elif self.fp8 is not None:
            out.use_fp8()
            out.fp8.weight, out.fp8.scale = self.fp8.weight[ids], self.fp8.scale.clone()
        else:
            out.weight = nn.Parameter(self.weight[ids], requires_grad=False)
        return out

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        if self.fp8 is not None:
            return self.fp8.dequantize(dtype)
        return self.nvfp4.dequantize(dtype) if self.nvfp4 is not None else self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.nvfp4 is not None and x.is_cuda:  # W4A16 kernel: the weight stays packed
            from fp4moe.kernels.nvfp4_gemm import nvfp4_linear

            q = self.nvfp4
            return nvfp4_linear(x.reshape(-1, x.shape[-1]), q.packed, q.block_scales, q.decode_scale).view(
                *x.shape[:-1], -1
            )
        if self.weight is not None and x.is_cuda:
            from fp4moe.kernels.nvfp4_gemv import FEW_ROWS, bf16_gemv, gemv_fits

            # decode rows: our GEMV beats cuBLAS's launch-bound kernels (1-4 rows, ``gemv_fits``)
            if gemv_fits(x, self.weight, max_rows=FEW_ROWS):
                return bf16_gemv(x.reshape(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], -1)
        if self.fp8 is not None and x.is_cuda and x.dtype == torch.bfloat16:  # weight-only FP8 kernel
            from fp4moe.kernels.nvfp4_gemm import fp8_linear

            flat = x.reshape(-1, x.shape[-1])
            return fp8_linear(flat, self.fp8.weight, self.fp8.scale).view(*x.shape[:-1], -1)
        return F.linear(x, self.dense_weight(x.dtype))
