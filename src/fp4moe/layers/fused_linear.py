"""Several Linears over the same input as one GEMM per weight format (``FusedLinear``): how the GPU forward
runs the projections that share an input -- qkv|z|b|a of Gated DeltaNet, q|k|v of attention, router|shared
gate|shared up|shared gate-scalar of the MoE. The Linears keep their own weights as views into the
concatenations, so fusing costs no memory. Kernels: cuBLAS, or ours at 1-4 bf16 rows and for NVFP4 / FP8
weights (``kernels.nvfp4_gemm``, ``kernels.nvfp4_gemv``). Reference: the Linears themselves (the tests)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FusedLinear:
    """Several Linears over the same input as one GEMM per weight format: the dense weights concatenated,
    and the NVFP4 (or FP8) ones concatenated when they share one decode scale -- vLLM's fused groups do,
    and ``fp4moe quantize`` writes them so -- else run one by one. The Linears' own tensors become views
    into the concatenations (no extra memory); outputs come back in the Linears' order. ``pad_to``: when
    every Linear is bf16, zero rows pad the weight to a multiple of that many outputs (the output has the
    extra columns): cuBLAS runs an odd width -- the router + shared-expert group's 1,281 -- through an
    unaligned kernel (H200: cutlass ``align1``, 10 us at 16 rows, 23 us at 3). ``trigger``: when our
    one-row GEMV lets the kernel behind it start (``kernels.pdl_args``)."""

    def __init__(self, linears: list, pad_to: int = 1, trigger: str = ""):
        self.sizes = [lin.out_features for lin in linears]
        self.linears = linears
        kinds: dict[str, list[int]] = {}
        for i, lin in enumerate(linears):
            kinds.setdefault(
                "nvfp4" if lin.nvfp4 is not None else "fp8" if lin.fp8 is not None else "dense", []
            ).append(i)
        self.parts = []  # (indices into linears, function of x)
        for kind, idx in kinds.items():
            group = [linears[i] for i in idx]
            if kind == "dense":
                pad = -sum(self.sizes) % pad_to if len(kinds) == 1 else 0
                self.parts.append((idx, _dense_part(group, pad, trigger)))
            elif kind == "nvfp4" and _same([lin.nvfp4.decode_scale for lin in group]):
                self.parts.append((idx, _nvfp4_part(group)))
            elif kind == "fp8" and _same([lin.fp8.scale for lin in group]):
                self.parts.append((idx, _fp8_part(group)))
            else:
                self.parts.extend(([i], linears[i]) for i in idx)
        self.ordered = [i for idx, _ in self.parts for i in idx] == list(range(len(linears)))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        outs = [fn(x) for _, fn in self.parts]
        if self.ordered:
            return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        pieces: list[torch.Tensor | None] = [None] * len(self.linears)
        for (idx, _), out in zip(self.parts, outs, strict=True):
            for i, piece in zip(idx, out.split([self.sizes[i] for i in idx], dim=-1), strict=True):
                pieces[i] = piece
        return torch.cat(pieces, dim=-1)


def _same(scales: list[torch.Tensor]) -> bool:
    return all(torch.equal(scales[0], s) for s in scales[1:])


def _concat_into(modules: list, name: str, pad: int = 0) -> torch.Tensor:
    """Concatenate ``module.<name>`` along dim 0 (then ``pad`` zero rows) and make each module's tensor a
    view of the result."""
    parts = [getattr(m, name).data for m in modules]
    whole = torch.cat(parts + [parts[0].new_zeros(pad, *parts[0].shape[1:])] * bool(pad))
    start = 0
    for m in modules:
        n = getattr(m, name).shape[0]
        view = whole[start : start + n]
        param = isinstance(getattr(m, name), nn.Parameter)
        setattr(m, name, nn.Parameter(view, requires_grad=False) if param else view)
        start += n
    return whole


def _few_rows_kernel(x: torch.Tensor) -> bool:
    """Whether bf16 projections of 2-4 rows take the grouped kernel (on the GPU; tests switch it on for
    the interpreter)."""
    return x.is_cuda


def _dense_part(linears: list, pad: int = 0, trigger: str = ""):
    from fp4moe.kernels.nvfp4_gemm import bf16_linear
    from fp4moe.kernels.nvfp4_gemv import bf16_gemv, gemv_fits

    weight = _concat_into(linears, "weight", pad)
    unpadded = weight[: weight.shape[0] - pad]

    def run(x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if (
            2 <= rows <= 4
            and weight.dtype == torch.bfloat16
            and x.shape[-1] % 16 == 0
            and _few_rows_kernel(x)
        ):
            # 2-4 rows (a batch-1 speculative verification, small batches): cuBLAS was up to 5x slower than
            # at 1 row on the unpadded router GEMM, and is 1.1x slower on the padded one (H200,
            # benchmarks/tune/tune_dense.py); the grouped kernel is not
            return bf16_linear(x.reshape(rows, -1), weight).view(*x.shape[:-1], -1)
        if rows == 1 and gemv_fits(x, unpadded):  # our GEMV (router group 3.6 us against cuBLAS's 4.6)
            return bf16_gemv(x.reshape(1, -1), unpadded, trigger=trigger).view(*x.shape[:-1], -1)
        return F.linear(x, unpadded if rows == 1 else weight)  # (one row: unpadded, as cuBLAS was faster)

    return run


def _nvfp4_part(linears: list):
    from fp4moe.kernels.nvfp4_gemm import nvfp4_linear

    qs = [lin.nvfp4 for lin in linears]
    packed, scales, decode = _concat_into(qs, "packed"), _concat_into(qs, "block_scales"), qs[0].decode_scale
    return lambda x: nvfp4_linear(x.reshape(-1, x.shape[-1]), packed, scales, decode).view(*x.shape[:-1], -1)


def _fp8_part(linears: list):
    from fp4moe.kernels.nvfp4_gemm import fp8_linear

    qs = [lin.fp8 for lin in linears]
    weight, scale = _concat_into(qs, "weight"), qs[0].scale
    return lambda x: fp8_linear(x.reshape(-1, x.shape[-1]), weight, scale).view(*x.shape[:-1], -1)
