"""The Triton device helpers against torch: ``round_bf16`` rounds fp32 to bf16 as torch's cast does (ties to
even, overflow to infinity, NaN kept), on the bits on every device."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from kernel_refs import DEV  # noqa: E402

from fp4moe.kernels.tl_helpers import round_bf16  # noqa: E402


@triton.jit
def _round_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, round_bf16(tl.load(x_ptr + offs, mask=mask)), mask=mask)


def test_round_bf16_is_torchs_cast():
    gen = torch.Generator().manual_seed(0)
    wide = torch.randn(4096, generator=gen) * (
        2.0 ** torch.randint(-140, 127, (4096,), generator=gen).float()
    )
    bf = torch.randint(-(2**15), 2**15, (2048,), generator=gen, dtype=torch.int32).to(torch.int16)
    grid = bf.view(torch.bfloat16).float()
    ties = (grid.view(torch.int32) | 0x8000).view(torch.float32)  # halfway between two bf16 values
    near = [ties.view(torch.int32) + d for d in (-1, 1)]
    special = torch.tensor(
        [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 3.3895e38, 3.4e38, -3.4e38, 1e-45]
    )
    canonical_nan = torch.tensor([0x7FFFFFFF, 0x7FC00000, -1], dtype=torch.int32).view(torch.float32)
    x = torch.cat([wide, grid, ties, *(v.view(torch.float32) for v in near), special, canonical_nan])
    out = torch.full_like(x, 7.0).to(DEV)
    _round_kernel[(triton.cdiv(x.numel(), 256),)](x.to(DEV), out, x.numel(), BLOCK=256)
    want = x.to(torch.bfloat16).float()
    got = out.cpu()
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))  # -0 and +0 told apart
