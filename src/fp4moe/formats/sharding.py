"""How stock vLLM splits a qwen3_5_moe checkpoint over N GPUs, and what that asks of its shapes.

Read in vLLM's source (0.34: ``fused_moe/routed_experts.py`` ``RoutedExperts.weight_loader``, ``fused_moe/
config.py``, the attention and Gated DeltaNet layers):

- **Tensor parallelism** (``--tensor-parallel-size N``) cuts every routed expert along its intermediate
  size I: gate (w1) and up (w3) keep rows [r*I/N, (r+1)*I/N) of [I, H], down (w2) the same range of its
  input columns. Packed NVFP4 codes hold two values a byte along K, block scales one per 16 along K, so
  down's codes are cut at byte I/(2N) and its scales at I/(16N): each rank's scales cover exactly its
  codes only when I/N is a multiple of the 16-value block (vLLM asserts only I % N == 0). Global scales are
  per expert and copied whole to every rank; vLLM keeps gate's and drops up's (so the two must be equal,
  as ``fp4moe quantize`` writes them). Attention splits the query heads and splits the key/value heads or,
  when N exceeds them, replicates them (then N must be a multiple of their count); Gated DeltaNet splits
  its key and value heads; the shared expert splits its intermediate size.
- **Expert parallelism** (``--enable-expert-parallel``): each GPU holds whole experts, contiguous ranges
  of E/N (the first E mod N one more), so no expert is cut; the rest of the model is split as above.

``problems`` lists what a config breaks for N GPUs (the serve recipe refuses those before vLLM does, deep
in its loader); ``expert_shard`` cuts one expert tensor as vLLM does (the tests dequantize the shards).
"""

from __future__ import annotations

import torch

from fp4moe.formats.nvfp4 import BLOCK_SIZE

# projection -> the dim of its [N, K] weight that tensor parallelism cuts
SHARDED_DIM = {"gate_proj": 0, "up_proj": 0, "down_proj": 1}


def problems(args, gpus: int, expert_parallel: bool, nvfp4_experts: bool = True) -> list[str]:
    """What stops vLLM from splitting a model of shapes ``args`` (the text model's ``ModelArgs``) over ``gpus``
    GPUs (empty: none)."""
    if gpus <= 1:
        return []
    out = []

    def need(ok: bool, message: str) -> None:
        if not ok:
            out.append(message)

    heads, kv = args.num_heads, args.num_kv_heads
    need(heads % gpus == 0, f"{heads} attention heads do not split over {gpus} GPUs")
    need(
        kv % gpus == 0 if gpus < kv else gpus % kv == 0,
        f"{kv} key/value heads neither split over {gpus} GPUs nor replicate evenly onto them",
    )
    for kind, n in (("key", args.linear_num_key_heads), ("value", args.linear_num_value_heads)):
        need(n % gpus == 0, f"{n} Gated DeltaNet {kind} heads do not split over {gpus} GPUs")
    shared = args.shared_intermediate_size
    need(shared % gpus == 0, f"the shared expert's {shared} intermediate rows do not split over {gpus} GPUs")
    experts, inter = args.num_experts, args.moe_intermediate_size
    if expert_parallel:
        need(experts >= gpus, f"{experts} experts leave some of {gpus} GPUs without one")
    elif inter % gpus:
        out.append(f"each expert's {inter} intermediate rows do not split over {gpus} GPUs")
    elif nvfp4_experts and (inter // gpus) % BLOCK_SIZE:
        out.append(
            f"each GPU's {inter // gpus} of an expert's {inter} intermediate rows are not whole {BLOCK_SIZE}-value "
            f"NVFP4 blocks: down_proj's block scales would not line up with its codes (expert parallelism keeps "
            "experts whole)"
        )
    return out


def expert_shard(tensor: torch.Tensor, proj: str, rank: int, gpus: int) -> torch.Tensor:
    """Rank ``rank``'s part of one routed expert's tensor under tensor parallelism, cut as vLLM cuts it: 2-D
    tensors (codes [N, K/2], block scales [N, K/16], or bf16 [N, K]) along ``SHARDED_DIM[proj]`` in equal
    floor-divided parts; per-expert scalars (global and input scales) whole."""
    if tensor.dim() < 2:
        return tensor
    dim = SHARDED_DIM[proj]
    size = tensor.shape[dim] // gpus
    return tensor.narrow(dim, size * rank, size)
