"""The fused small kernels of a decoder layer: the router with the shared expert's activation, add + RMSNorm and
the MoE combine, against torch. Tolerances (kernel_refs.py): relative L2 error 2e-2 for bf16 outputs; integer
outputs exact."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_refs import BF16, DEV, RTOL, rel  # noqa: E402

from fp4moe.kernels import moe_router, norm  # noqa: E402
from fp4moe.layers.norm import rms_norm_zero_centred  # noqa: E402


def test_router_and_shared_activation():
    gen = torch.Generator().manual_seed(3)
    t, e, k, s = 9, 32, 8, 24
    proj = torch.randn(t, e + 2 * s + 1, generator=gen).to(BF16).to(DEV)
    ids, w, shared = moe_router.route(proj, e, k, s)
    ref_ids, ref_w = moe_router.router_reference(proj[:, :e], k)
    # equal bf16 logits may come in either order (torch.topk leaves ties unordered): compare as sets
    order, ref_order = ids.long().sort(-1), ref_ids.sort(-1)
    assert torch.equal(order.values.cpu(), ref_order.values.cpu())
    torch.testing.assert_close(
        w.gather(1, order.indices), ref_w.gather(1, ref_order.indices), rtol=1e-5, atol=1e-6
    )
    g, u = proj[:, e : e + s], proj[:, e + s : e + 2 * s]
    assert rel(shared, torch.nn.functional.silu(g) * u) < RTOL


@pytest.mark.filterwarnings("ignore:All-NaN slice")  # the interpreter's numpy max over the NaN row
def test_router_keeps_expert_ids_in_range_whatever_its_logits():
    """A row of NaN logits (a NaN in the residual stream) still routes to experts that exist: an id past the last
    would send the expert kernels out of bounds."""
    t, e, k = 3, 32, 8
    proj = torch.randn(t, e, generator=torch.Generator().manual_seed(5)).to(BF16).to(DEV)
    proj[1] = float("nan")
    ids, _, _ = moe_router.route(proj, e, k, 0)
    assert bool(((ids >= 0) & (ids < e)).all())
    ref_ids, _ = moe_router.router_reference(proj[[0, 2], :e], k)
    assert torch.equal(ids[[0, 2]].long().sort(-1).values.cpu(), ref_ids.sort(-1).values.cpu())


def test_add_norm_and_moe_combine():
    gen = torch.Generator().manual_seed(4)
    t, n, k = 5, 96, 4
    h, a = (torch.randn(t, n, generator=gen).to(BF16).to(DEV) for _ in range(2))
    w = (0.1 * torch.randn(n, generator=gen)).to(BF16).to(DEV)
    h_out, x = norm.add_rms_norm(h, a, w, 1e-6)
    assert rel(h_out, h + a) < 1e-2 and rel(x, rms_norm_zero_centred(h + a, w, 1e-6)) < RTOL
    _, x0 = norm.add_rms_norm(h, None, w, 1e-6)
    assert rel(x0, rms_norm_zero_centred(h, w, 1e-6)) < RTOL
    y = torch.randn(t * k, n, generator=gen).to(DEV)
    shared = torch.randn(t, n, generator=gen).to(BF16).to(DEV)
    proj = torch.randn(t, 7, generator=gen).to(BF16).to(DEV)
    h2, x2 = norm.moe_combine(h, y, k, shared, proj, 6, w, 1e-6)
    ref = h.float() + y.view(t, k, n).sum(1) + torch.sigmoid(proj[:, 6:7].float()) * shared.float()
    assert rel(h2, ref) < RTOL and rel(x2, rms_norm_zero_centred(ref.to(BF16), w, 1e-6)) < RTOL


@pytest.mark.parametrize("heads,rotary", [(4, 16), (2, 64), (3, 0)])
def test_head_norm_rope_is_the_norm_then_the_rotary(heads, rotary):
    """q/k norm + rotary in one pass over heads read at their projection's strides (q's query half of each
    query/gate row; k out of a wider row): the rotary over the kernel's own normed heads (cos 1, sin 0 give
    those back) exactly -- products of bf16 values are exact in fp32 and each is rounded where torch rounds --
    and the norm against torch's fp32 chain within the relative tolerance (another summation order)."""
    from fp4moe.layers.rope import Rotary

    gen = torch.Generator().manual_seed(heads + rotary)
    t, d, eps = 7, 64, 1e-6
    q_gate = torch.randn(t, heads, 2 * d, generator=gen).to(BF16)
    q = q_gate.to(DEV).chunk(2, dim=-1)[0]  # [t, heads, d] at stride 2d per head
    row = torch.randn(t, heads * d + 24, generator=gen).to(BF16).to(DEV)
    k = row[:, 8 : 8 + heads * d].view(t, heads, d)  # rows at the wider projection's stride
    w = (0.1 * torch.randn(d, generator=gen)).to(BF16).to(DEV)
    angle = torch.rand(t, rotary, generator=gen) * 6.3
    cos, sin = angle.cos().to(BF16).to(DEV), angle.sin().to(BF16).to(DEV)
    one, zero = torch.ones_like(cos), torch.zeros_like(sin)
    for x in (q, k):
        got = norm.head_norm_rope(x, w, eps, cos, sin)
        assert got.shape == x.shape and got.is_contiguous()
        normed = norm.head_norm_rope(x, w, eps, one, zero)
        assert rel(normed, rms_norm_zero_centred(x, w, eps)) < RTOL
        ref = Rotary.apply(normed.cpu(), cos.cpu(), sin.cpu()) if rotary else normed.cpu()
        assert torch.equal(got.cpu(), ref)
    with pytest.raises(ValueError, match="rotary dims"):
        odd = torch.zeros(t, 3, dtype=BF16, device=DEV)
        norm.head_norm_rope(q, w, eps, odd, odd)


def test_add_norm_rounds_like_the_modules():
    """Where the kernel's arithmetic is the modules' (the residual sum rounded to bf16, as the modules' bf16 add
    does; the norm in fp32 from that bf16 residual), it is held to their rounding, not the 2e-2 of a kernel
    in another order: the residual bit for bit, the normed output with at most 1 element in 200 one bf16 ulp
    off (the fp32 mean of squares summed in another order flips a last bit now and then). Norming the
    unrounded sum instead moved a third of the outputs by an ulp."""
    gen = torch.Generator().manual_seed(7)
    t, n = 16, 256
    h, a = (torch.randn(t, n, generator=gen).to(BF16).to(DEV) for _ in range(2))
    w = (0.1 * torch.randn(n, generator=gen)).to(BF16).to(DEV)
    h_out, x = norm.add_rms_norm(h, a, w, 1e-6)
    assert torch.equal(h_out, h + a)
    ref = rms_norm_zero_centred(h + a, w, 1e-6)
    off = (x.float() - ref.float()).abs()
    ulp = ref.float().abs() * 2**-7  # one bf16 ulp is at most 2^-7 of the value
    assert (off <= ulp).all() and (off > 0).float().mean() <= 1 / 200, (off > 0).float().mean()
