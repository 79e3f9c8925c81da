"""Per-tensor FP8-E4M3 (``formats/fp8.py``), the arithmetic the quantizer's FP8 groups, the FP8 linear and the
fp8 KV cache share, against torch's own e4m3 conversion: exact, since both are one division and one
round-to-nearest-even per element."""

from __future__ import annotations

import torch

from fp4moe.formats import fp8


def test_scale_maps_the_amax_times_headroom_to_448():
    amax = torch.tensor(896.0)
    assert fp8.scale_from_amax(amax).item() == 2.0
    assert fp8.scale_from_amax(amax, headroom=2.0).item() == 4.0
    assert fp8.scale_from_amax(torch.tensor(0.0)).item() == torch.finfo(torch.float32).tiny  # zeros: usable
    assert fp8.scale_from_amax(torch.tensor(0.0), floor=1e-8).item() == torch.tensor(1e-8).item()


def test_encode_saturates_and_rounds_like_torch_and_decode_inverts_exact_codes():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=gen) * 300
    scale = torch.tensor(0.5)
    codes = fp8.encode(x, scale)
    assert codes.dtype == fp8.DTYPE
    assert torch.equal(codes.view(torch.uint8), (x / scale).clamp(-448, 448).to(fp8.DTYPE).view(torch.uint8))
    assert fp8.decode(codes, scale, torch.float32).abs().max().item() == 448 * 0.5  # saturated, not inf
    exact = torch.tensor([0.0, 1.0, -2.5, 448.0, 0.001953125])  # e4m3 values (the last is the smallest)
    assert torch.equal(
        fp8.decode(fp8.encode(exact, torch.tensor(1.0)), torch.tensor(1.0), torch.float32), exact
    )
