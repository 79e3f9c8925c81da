"""Block-scale selection: every method against round-to-nearest, and exactness on representable blocks."""

import pytest
import torch

from fp4moe.formats import nvfp4
from fp4moe.quantize import scales
from fp4moe.quantize.experts import quantize_weight
from fp4moe.quantize.scales import ScaleMethod, choose_block_scales

METHODS = [ScaleMethod.FOUR_OVER_SIX, ScaleMethod.MSE]


def block_mse(w: torch.Tensor, q: nvfp4.NVFP4Tensor) -> torch.Tensor:
    err = (q.dequantize(torch.float32) - w.float()) ** 2
    return err.unflatten(-1, (w.shape[-1] // 16, 16)).sum(-1)  # [N, K/16]


def heavy_tailed(shape, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.distributions.StudentT(2.0).sample(shape) * 0.02 + torch.randn(shape, generator=gen) * 1e-3


def reference_block_scales(w: torch.Tensor, global_scale: torch.Tensor, method: ScaleMethod) -> torch.Tensor:
    """The search written out plainly: every block of the whole tensor quantized (codes, then their values)
    under each candidate, the squared error summed, the first smallest kept."""
    blocks = w.float().unflatten(-1, (w.shape[-1] // 16, 16))
    gs = global_scale.float().reshape(*global_scale.shape, 1, 1, 1)
    best = best_err = None
    for cand in scales._candidates(blocks.abs().amax(-1), global_scale, method):
        eff = cand.float().unsqueeze(-1) / gs
        codes = nvfp4.e2m1_codes(torch.clamp(blocks / eff, -nvfp4.FP4_MAX, nvfp4.FP4_MAX))
        err = ((nvfp4.e2m1_values(codes) * eff - blocks) ** 2).sum(-1)
        if best is None:
            best, best_err = cand.view(torch.uint8), err
            continue
        better = err < best_err
        best, best_err = torch.where(better, cand.view(torch.uint8), best), torch.where(better, err, best_err)
    return best.view(nvfp4.FP8_DTYPE)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(
    "shape", [(3, 96, 512), (700, 64), (5, 40, 16)], ids=["experts", "matrix", "gptq-group"]
)
def test_the_chunked_search_chooses_what_the_plain_search_does(method, shape, monkeypatch):
    """Chunks of 64 blocks (the last one short), over heavy-tailed weights, weights already on the NVFP4
    grid (candidates tie: the first must win) and all-zero rows."""
    monkeypatch.setattr(scales, "CPU_CHUNK_BLOCKS", 64)
    w = heavy_tailed(shape, 4).to(torch.bfloat16)
    q = quantize_weight(w.float(), ScaleMethod.RTN)
    w[..., : shape[-2] // 3, :] = q.dequantize(torch.bfloat16)[..., : shape[-2] // 3, :]
    w[..., -1, :] = 0
    global_scale = nvfp4.global_scale_from_amax(w.float().abs().amax(dim=(-2, -1)))
    ours = choose_block_scales(w, global_scale, method)
    assert ours.shape == (*shape[:-1], shape[-1] // 16)
    assert torch.equal(
        ours.view(torch.uint8), reference_block_scales(w, global_scale, method).view(torch.uint8)
    )


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
