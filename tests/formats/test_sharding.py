"""How vLLM splits our checkpoints over GPUs (``formats.sharding``): which shapes split, and that an NVFP4
expert cut as vLLM's loader cuts it dequantizes to the same cut of the whole expert -- exactly, since
dequantization is elementwise per 16-value block -- where the blocks line up."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fp4moe.formats import nvfp4, sharding
from fp4moe.models.qwen3_5_moe import REAL_TEXT_CONFIG, ModelArgs

FULL = ModelArgs.from_text_config(REAL_TEXT_CONFIG)


@pytest.mark.parametrize("gpus", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("expert_parallel", [True, False])
def test_the_full_size_model_splits_over_powers_of_two(gpus, expert_parallel):
    assert sharding.problems(FULL, gpus, expert_parallel) == []


def test_what_does_not_split_is_named():
    found = sharding.problems(FULL, 3, expert_parallel=False)
    text = "; ".join(found)
    for part in (
        "16 attention heads",
        "2 key/value heads",
        "16 Gated DeltaNet key heads",
        "512 intermediate",
    ):
        assert part in text, part
    assert len(sharding.problems(FULL, 32, expert_parallel=True)) == 2  # heads, DeltaNet keys
    # experts whose per-GPU share is not whole NVFP4 blocks: refused for tensor parallelism, fine for EP
    odd = dataclasses.replace(FULL, moe_intermediate_size=48, shared_intermediate_size=64)
    (only,) = sharding.problems(odd, 2, expert_parallel=False)
    assert "24 of an expert's 48" in only and "block scales" in only
    assert sharding.problems(odd, 2, expert_parallel=False, nvfp4_experts=False) == []
    assert sharding.problems(odd, 2, expert_parallel=True) == []


def _expert(gen, h: int, inter: int) -> dict[str, nvfp4.NVFP4Tensor]:
    gate, up = torch.randn(2, inter, h, generator=gen)
    shared = nvfp4.global_scale_from_amax(torch.stack([gate, up]).abs().amax())  # as fp4moe quantize writes
    return {
        "gate_proj": nvfp4.quantize(gate, shared),
        "up_proj": nvfp4.quantize(up, shared),
        "down_proj": nvfp4.quantize(torch.randn(h, inter, generator=gen)),
    }


@pytest.mark.parametrize("gpus", [2, 4])
def test_tensor_parallel_shards_dequantize_to_the_shards_of_the_expert(gpus):
    gen = torch.Generator().manual_seed(gpus)
    h, inter = 64, 128
    for proj, q in _expert(gen, h, inter).items():
        whole = nvfp4.dequantize(q.packed, q.block_scales, q.global_scale)
        dim = sharding.SHARDED_DIM[proj]
        size = inter // gpus
        for rank in range(gpus):
            packed, scales, gs = (
                sharding.expert_shard(t, proj, rank, gpus) for t in (q.packed, q.block_scales, q.global_scale)
            )
            assert torch.equal(gs, q.global_scale)  # per expert, on every rank
            got = nvfp4.dequantize(packed, scales, gs)
            assert torch.equal(got, whole.narrow(dim, size * rank, size)), (proj, rank)


def test_a_share_of_partial_blocks_misaligns_down_projs_scales():
    """What ``problems`` refuses: I / N = 24 values a GPU, one and a half blocks -- the floor-divided cut of
    down's scales covers 16 of the 24 values its codes hold."""
    q = _expert(torch.Generator().manual_seed(0), 64, 48)["down_proj"]
    packed = sharding.expert_shard(q.packed, "down_proj", 1, 2)
    scales = sharding.expert_shard(q.block_scales, "down_proj", 1, 2)
    assert packed.shape[-1] * 2 == 24 and scales.shape[-1] * nvfp4.BLOCK_SIZE == 16
