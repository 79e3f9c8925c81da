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


def state_bytes_per_sequence(args, dtype: torch.dtype, spec_tokens: int = 0) -> int:
    """One sequence slot of the GPU runner: its Gated DeltaNet states, and with ``spec_tokens`` k the per-token
    recurrent states a verification keeps (``CudaModelRunner.history``) and the conv ring's k + 1 more rows."""
    num_deltanet = sum(t == "linear_attention" for t in args.layer_types)
    recurrent = args.linear_num_value_heads * args.linear_key_head_dim * args.linear_value_head_dim * 4
    ring = args.conv_dim * torch.tensor([], dtype=dtype).element_size()
    extra = num_deltanet * (recurrent + ring) * (spec_tokens + 1) if spec_tokens else 0
    return deltanet_bytes_per_sequence(args, dtype) + extra


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


def kv_pages(
    free: int,
    total: int,
    per_token: int,
    utilization: float,
    max_num_seqs: int,
    max_model_len: int,
    page_size: int,
) -> int:
    """Pages of the GPU runner's paged KV cache: those that fit in ``utilization`` x ``total`` bytes after what
    is in use (``total - free``: the weights, the states, allocated already) and an activation reserve (a
    prefill chunk of 8K tokens measured ~3 GB at full size; 4 GiB kept), at most what ``max_num_seqs``
    sequences of ``max_model_len`` tokens fill (and one page more)."""
    tokens = cache_budget_tokens(total, total - free + (4 << 30), utilization, per_token, 0, max_num_seqs)
    if tokens < 16 * page_size:
        raise ValueError(f"not enough GPU memory for a KV cache: {tokens * per_token / 2**30:.1f} GiB left")
    want = max_num_seqs * -(-max_model_len // page_size) + 1
    return int(min(want, tokens // page_size))


AUTO_SEQS_CAP = 256  # the largest CUDA-graph bucket
AUTO_SEQS_SHARE = 0.25  # of the memory left after the weights: the rest is the KV cache's


def auto_max_num_seqs(
    total_bytes: int,
    used_bytes: int,
    utilization: float,
    per_sequence: int,
    buckets,
    cap: int = AUTO_SEQS_CAP,
) -> int:
    """``--max-num-seqs auto`` on the GPU: the largest graph bucket (up to ``cap``) whose sequences' fixed
    state (``per_sequence`` bytes each: Gated DeltaNet states, and speculation's per-token history) takes at
    most a quarter of what ``utilization`` of the device leaves after the model; the rest holds the KV
    cache, which then bounds how many are really admitted (vLLM sizes its batch the same way, with no fixed
    per-sequence state to pay for)."""
    room = int(total_bytes * utilization) - used_bytes
    fits = [b for b in buckets if b <= cap and b * per_sequence <= AUTO_SEQS_SHARE * room]
    if not fits:
        raise ValueError(
            f"not enough GPU memory for one sequence's state ({per_sequence / 2**20:.0f} MiB) beside the model "
            f"({used_bytes / 2**30:.1f} GiB); raise --gpu-memory-utilization"
        )
    return max(fits)
