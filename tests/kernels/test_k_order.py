"""The K order of the Hopper prefill expert GEMMs (``kernels.k_order``): the torch functions agree with each other
and with the Triton helper kernels use to write activations in it (``logical_column``, run here under Triton's
interpreter, on the GPU in the post-attention norm), and the norm's K-order output is its normal output
reordered, exactly."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from kernel_refs import BF16, DEV  # noqa: E402

from fp4moe.kernels import k_order as ko  # noqa: E402
from fp4moe.kernels import norm  # noqa: E402


def test_permute_k_is_a_gather_of_each_chunk_and_inverts():
    x = torch.randn(5, 384)
    order = ko.k_order(384)
    assert sorted(order.tolist()) == list(range(384))
    assert bool((order // 128 == torch.arange(384) // 128).all())  # each chunk stays in place
    assert torch.equal(ko.permute_k(x), x[:, order])
    assert torch.equal(ko.unpermute_k(ko.permute_k(x)), x)
    # logical 32 j + 16 h + 8 q + 2 c + t holds physical 32 c + 8 j + 4 q + 2 t + h: e.g. 1 -> 2, 2 -> 32, 16 -> 1
    assert order[:4].tolist() == [0, 2, 32, 34] and int(order[16]) == 1 and int(order[8]) == 4
    with pytest.raises(ValueError, match="multiple of 128"):
        ko.permute_k(torch.zeros(2, 96))


@triton.jit
def _scatter(out_ptr, N: tl.constexpr):
    p = tl.arange(0, N)
    tl.store(out_ptr + ko.logical_column(p), p)


def test_logical_column_puts_each_column_where_permute_k_does():
    out = torch.full((512,), -1, dtype=torch.int32, device=DEV)
    _scatter[(1,)](out, N=512)
    assert torch.equal(out.cpu().long(), ko.k_order(512))


@pytest.mark.parametrize("add", [False, True])
def test_norm_writes_its_output_in_the_k_order_too(add):
    gen = torch.Generator().manual_seed(6)
    t, n = 7, 256
    h, a = (torch.randn(t, n, generator=gen).to(BF16).to(DEV) for _ in range(2))
    w = (0.1 * torch.randn(n, generator=gen)).to(BF16).to(DEV)
    x_k = torch.empty(t, n, dtype=BF16, device=DEV)
    h_out, x = norm.add_rms_norm(h, a if add else None, w, 1e-6, x_k=x_k)
    _, plain = norm.add_rms_norm(h, a if add else None, w, 1e-6)
    assert torch.equal(x, plain) and torch.equal(x_k, ko.permute_k(x))
    with pytest.raises(ValueError, match="K-order output"):
        norm.add_rms_norm(h[:, :96], None, w[:96], 1e-6, x_k=x_k[:, :96])
