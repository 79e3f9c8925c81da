"""``FusedLinear`` (layers/fused_linear.py): several Linears over one input as one GEMM per format, against
the Linears themselves. Without CUDA the kernels run under Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_fused_projection_of_a_few_rows_through_the_grouped_kernel(monkeypatch):
    """FusedLinear's bf16 part at 2-4 rows (the GPU takes the grouped kernel there, cuBLAS being slow for
    some thin shapes) gives the concatenated Linears' outputs, in their order, for [T, K] and [B, T, K]."""
    from fp4moe.kernels import nvfp4_gemm
    from fp4moe.layers import fused_linear
    from fp4moe.layers.fused_linear import FusedLinear
    from fp4moe.layers.linear import Linear

    monkeypatch.setattr(fused_linear, "_few_rows_kernel", lambda x: True)
    calls = []
    kernel = nvfp4_gemm.bf16_linear
    monkeypatch.setattr(nvfp4_gemm, "bf16_linear", lambda x, w: calls.append(x.shape[0]) or kernel(x, w))
    torch.manual_seed(0)
    linears = [Linear(64, n) for n in (48, 17, 1)]
    for lin in linears:
        lin.weight.data = (torch.randn(lin.out_features, 64) * 0.1).to(torch.bfloat16).to(DEV)
    expected = lambda x: torch.cat([x.double() @ lin.weight.double().T for lin in linears], -1)  # noqa: E731
    fused = FusedLinear(linears)
    for shape in ((3, 64), (1, 2, 64), (4, 64)):
        x = torch.randn(*shape).to(torch.bfloat16).to(DEV)
        out = fused(x)
        assert out.shape == (*shape[:-1], 66)
        ref = expected(x)
        assert float((out.double() - ref).norm() / ref.norm()) < 2e-2
    assert calls == [3, 2, 4]  # every one of them went through the kernel


def test_router_group_is_padded_to_a_multiple_of_eight_outputs():
    """FusedLinear(pad_to=8) adds zero rows (the router + shared group's 1,281 outputs are odd): the output
    has the padded width, the Linears' columns in order and zeros after them; one row takes the unpadded
    view (cuBLAS's GEMV); the Linears' own weights stay views of the concatenation."""
    from fp4moe.layers.fused_linear import FusedLinear
    from fp4moe.layers.linear import Linear

    torch.manual_seed(0)
    linears = [Linear(64, n) for n in (48, 17, 1)]
    for lin in linears:
        lin.weight.data = (torch.randn(lin.out_features, 64) * 0.1).to(torch.bfloat16).to(DEV)
    fused = FusedLinear(linears, pad_to=8)
    expected = lambda x: torch.cat([x.double() @ lin.weight.double().T for lin in linears], -1)  # noqa: E731
    for rows, width in ((1, 66), (5, 72), (3, 72)):
        x = torch.randn(rows, 64).to(torch.bfloat16).to(DEV)
        out = fused(x)
        assert out.shape == (rows, width)
        ref = expected(x)
        assert float((out[:, :66].double() - ref).norm() / ref.norm()) < 2e-2
        assert not out[:, 66:].any()
    linears[1].weight.data.zero_()  # a view: the fused GEMM sees it
    assert not fused(torch.randn(5, 64).to(torch.bfloat16).to(DEV))[:, 48:65].any()
