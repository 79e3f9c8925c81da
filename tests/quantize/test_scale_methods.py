"""Block-scale selection: every method against round-to-nearest, and exactness on representable blocks."""

import pytest
import torch

from fp4moe.formats import nvfp4
from fp4moe.quantize.experts import quantize_weight
from fp4moe.quantize.scales import ScaleMethod, choose_block_scales

METHODS = [ScaleMethod.FOUR_OVER_SIX, ScaleMethod.MSE]


def block_mse(w: torch.Tensor, q: nvfp4.NVFP4Tensor) -> torch.Tensor:
    err = (q.dequantize(torch.float32) - w.float()) ** 2
    return err.unflatten(-1, (w.shape[-1] // 16, 16)).sum(-1)  # [N, K/16]


def heavy_tailed(shape, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.distributions.StudentT(2.0).sample(shape) * 0.02 + torch.randn(shape, generator=gen) * 1e-3


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_never_worse_than_rtn_per_block_and_better_overall(method, seed):
    torch.manual_seed(seed)
    w = heavy_tailed((64, 256), seed)
    rtn = block_mse(w, quantize_weight(w, ScaleMethod.RTN))
    ours = block_mse(w, quantize_weight(w, method))
    assert (ours <= rtn).all()
    assert ours.sum() < 0.97 * rtn.sum()  # and it finds something: > 3% less squared error in total


@pytest.mark.parametrize("method", [ScaleMethod.RTN, *METHODS])
def test_blocks_whose_max_maps_to_6_are_reproduced_exactly(method):
    w = quantize_weight(torch.randn(32, 128), ScaleMethod.RTN)
    exact = w.dequantize(torch.float32)  # representable under w's global scale, block max code 6 (or 0)
    scales = choose_block_scales(exact, w.global_scale, method)
    q = nvfp4.quantize_with_scales(exact, scales, w.global_scale)
    back = nvfp4.dequantize(q, scales, w.global_scale, torch.float32)
    torch.testing.assert_close(back, exact, rtol=0, atol=0)


@pytest.mark.parametrize("method", METHODS)
def test_blocks_whose_max_is_4_are_exact_where_rtn_is_not(method):
    gen = torch.Generator().manual_seed(3)
    # codes up to 4 (never 6), one block scale each: RTN maps the max 4 to 6 and rounds the rest off-grid
    values = nvfp4.E2M1_VALUES[torch.randint(0, 7, (16, 64), generator=gen)]  # 0 .. 4
    values[:, ::16] = 4.0
    sign = torch.where(torch.rand(16, 64, generator=gen) < 0.5, -1.0, 1.0)
    block_scale = torch.tensor([1.0, 1.5, 2.0, 3.0]).repeat(16, 1)  # e4m3-representable, per block
    global_scale = torch.tensor(448.0 * 6 / 40.0)
    w = (values * sign).unflatten(-1, (4, 16)) * (block_scale / global_scale).unsqueeze(-1)
    w = w.flatten(-2)
    rtn = choose_block_scales(w, global_scale, ScaleMethod.RTN)
    ours = choose_block_scales(w, global_scale, method)

    def err(scales):
        q = nvfp4.quantize_with_scales(w, scales, global_scale)
        return (nvfp4.dequantize(q, scales, global_scale, torch.float32) - w).abs().max()

    assert err(ours) == 0 and err(rtn) > 0


def test_quantize_with_mse_scales_is_sound_and_closer_to_the_source(checkpoints):
    from fixtures import load_all
    from fp4moe.quantize.dequant import dequantized_state_dict
    from fp4moe.quantize.inspect import inspect_checkpoint

    source = load_all(checkpoints.bf16())
    errors = {}
    for method in ("rtn", "mse"):
        path = checkpoints.quantized(scale_method=method)
        assert inspect_checkpoint(path).ok
        deq = dequantized_state_dict(path)
        names = [n for n in deq if "mlp.experts" in n and n in source and deq[n].shape == source[n].shape]
        assert names
        errors[method] = sum(float(((deq[n].float() - source[n].float()) ** 2).sum()) for n in names)
    assert errors["mse"] < errors["rtn"]
