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
