"""What the kernel tests share: the device (CUDA when there is one, else the CPU under Triton's interpreter;
tests/conftest.py sets TRITON_INTERPRET), the tolerance and the quantized random weights.

Tolerances: relative L2 error 2e-2 for bf16 outputs -- the kernels keep the CPU path's bf16 roundings at
the same places but accumulate in a different order and skip a few intermediate roundings (e.g. the
decode scale is applied to the fp32 accumulator rather than to each bf16 weight), so single elements differ
by a bf16 ulp; a wrong index or scale gives errors of order 1. Integer outputs (routing tables) are exact.
"""

from __future__ import annotations

import torch

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BF16 = torch.bfloat16
RTOL = 2e-2
# modes 4 and 7 compute in bf16 on bf16 bit patterns, subnormals included (7 through inline PTX);
# Triton's interpreter flushes bf16 subnormals, its bf16 multiply is not IEEE and it runs no PTX, so they
# are checked on the GPU only
BF16_INTERPRETER = "bf16-bit dequantization needs IEEE bf16 arithmetic: GPU only"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all()
    return float((a - b).norm() / b.norm())


def quantized(shape, gen, per=None):
    """Random weights [.., N, K] quantized with one global scale per [N, K] matrix (or per ``per`` rows);
    MSE block scales, the quantizer's default (any e4m3 scale, not just RTN's amax/6 ones)."""
    from fp4moe.quantize.experts import quantize_weight
    from fp4moe.quantize.scales import ScaleMethod

    w = torch.randn(*shape, generator=gen) * torch.rand(*shape[:-2], 1, 1, generator=gen).add(0.5)
    q = quantize_weight(w, ScaleMethod.MSE)
    return q.packed.to(DEV), q.block_scales.to(DEV), (1.0 / q.global_scale).float().to(DEV)
