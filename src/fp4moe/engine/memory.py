"""Sizing the caches from device memory (``--gpu-memory-utilization``), after the model is loaded."""

from __future__ import annotations

import torch


def kv_bytes_per_token(args, kv_cache_dtype: str, dtype: torch.dtype) -> int:
    """Bytes one token's keys and values take across the attention layers."""
    num_attention = sum(t == "full_attention" for t in args.layer_types)
    elem = 1 if kv_cache_dtype == "fp8" else torch.tensor([], dtype=dtype).element_size()
    return num_attention * 2 * args.num_kv_heads * args.head_dim * elem


def deltanet_bytes_per_sequence(args, dtype: torch.dtype) -> int:
    """Conv (model dtype) and fp32 recurrent state of every Gated DeltaNet layer, for one sequence."""
    num_deltanet = sum(t == "linear_attention" for t in args.layer_types)
    conv = args.conv_dim * (args.conv_kernel - 1) * torch.tensor([], dtype=dtype).element_size()
    recurrent = args.linear_num_value_heads * args.linear_key_head_dim * args.linear_value_head_dim * 4
    return num_deltanet * (conv + recurrent)


def cache_budget_tokens(
    total_bytes: int,
    used_bytes: int,
    utilization: float,
    per_token: int,
    per_sequence: int,
    max_num_seqs: int,
) -> int:
    """Tokens of KV that fit in ``utilization`` of the device once the model (``used_bytes``) and the
    DeltaNet states of ``max_num_seqs`` sequences are accounted for."""
    if not 0 < utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
    free = int(total_bytes * utilization) - used_bytes - per_sequence * max_num_seqs
    if free < per_token:
        raise ValueError(
            f"no room for the KV cache: {utilization:.0%} of {total_bytes / 2**30:.1f} GiB is taken by the model "
            f"({used_bytes / 2**30:.1f} GiB) and {max_num_seqs} DeltaNet states; raise --gpu-memory-utilization "
            "or lower --max-num-seqs"
        )
    return free // per_token
