"""Layer-by-layer calibration: hidden states go through one decoder layer at a time (only that layer's
weights in memory) and every routed expert's input amax is taken from the tokens the router sent it.

The layer math is transformers' own ``Qwen3_5MoeDecoderLayer`` (our reference for the model). Expert
statistics are not taken from hooks on linears -- transformers' grouped-GEMM experts bypass ``F.linear``,
the bug behind missing input scales elsewhere. Instead a hook on the router captures the exact MoE input
and the exact top-k indices the experts receive, and the expert activations are recomputed explicitly
from them: gate/up input = the routed hidden state, down input = silu(gate x) * (up x).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fp4moe.models.qwen3_5_moe import text_config_dict


@dataclass
class ExpertStats:
    """Calibration statistics of one MoE block's routed experts; float32 [E] / int64 [E]."""

    gate_up_amax: torch.Tensor  # amax of each expert's input (0 where it saw no token)
    down_amax: torch.Tensor  # amax of silu(gate x) * up x
    num_tokens: torch.Tensor  # tokens routed to each expert (with --calibrate-all-experts: all tokens)
    input_amax: torch.Tensor  # 0-D: amax of the MoE input over all tokens
    gate_up_hessian: torch.Tensor | None = None  # [E, H, H] sum of x xᵀ of each expert's input (--gptq)
    down_hessian: torch.Tensor | None = None  # [E, I, I] the same for the down input

    @classmethod
    def empty(cls, num_experts: int) -> ExpertStats:
        z = torch.zeros(num_experts, dtype=torch.float32)
        return cls(z.clone(), z.clone(), torch.zeros(num_experts, dtype=torch.int64), torch.zeros(()))

    @property
    def calibrated(self) -> torch.Tensor:
        return self.num_tokens > 0


def text_config_for(raw_config: dict):
    """transformers' text config from a checkpoint's config.json dict, set up for calibration."""
    from transformers import Qwen3_5MoeTextConfig

    text = dict(text_config_dict(raw_config))
    for key in ("model_type", "architectures", "transformers_version", "dtype", "torch_dtype"):
        text.pop(key, None)
    known = set(Qwen3_5MoeTextConfig.__dataclass_fields__) | {
        "full_attention_interval",
        "partial_rotary_factor",
    }
    cfg = Qwen3_5MoeTextConfig(**{k: v for k, v in text.items() if k in known})
    cfg._attn_implementation = "sdpa"  # causal without an explicit mask
    cfg._experts_implementation = "grouped_mm"  # transformers' default; expert stats do not depend on it
    return cfg


def build_layer(
    text_config, idx: int, tensors: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device
):
    """transformers' decoder layer ``idx`` holding ``tensors`` (names relative to the layer; fused experts)."""
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeDecoderLayer

    from fp4moe.formats.checkpoint import CheckpointError

    with torch.device("meta"):
        layer = Qwen3_5MoeDecoderLayer(text_config, idx)
    expected = set(layer.state_dict())
    missing, unexpected = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or unexpected:
        raise CheckpointError(
            f"decoder layer {idx} ({text_config.layer_types[idx]}): missing tensors {missing[:4]}"
            + (f", unexpected {unexpected[:4]}" if unexpected else "")
        )
    state = {k: v.to(device=device, dtype=dtype) for k, v in tensors.items()}
    layer.load_state_dict(state, strict=True, assign=True)
    return layer.eval()


def rotary_for(text_config, device: torch.device):
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTextRotaryEmbedding

    return Qwen3_5MoeTextRotaryEmbedding(config=text_config).to(device)


def expert_down_input(x: torch.Tensor, gate_up: torch.Tensor, act=F.silu) -> torch.Tensor:
    """act(gate x) * up x [T, I] for one expert; x [T, H], gate_up [2I, H]."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)  # [T, I] each
    return act(gate) * up


class KVTap:
    """Stands in for transformers' cache at a full-attention layer: ``update`` sees the keys after the k-norm
    and rotary and the values, as a KV cache stores them, and keeps each head's amax (float32 [2, Hkv]: k, v).
    The layer attends over exactly what it was given (nothing is cached)."""

    def __init__(self):
        self.amax: torch.Tensor | None = None

    def update(self, key_states, value_states, layer_idx=None, *args, **kwargs):
        # [B, Hkv, S, D] each
        heads = torch.stack(
            [x.detach().abs().amax(dim=(0, 2, 3)).float().cpu() for x in (key_states, value_states)]
        )
        self.amax = heads if self.amax is None else torch.maximum(self.amax, heads)
        return key_states, value_states


def _cache_kwarg(layer) -> str:
    """The decoder layer's name for its cache argument (``cache`` in newer transformers)."""
    import inspect

    return "cache" if "cache" in inspect.signature(layer.forward).parameters else "past_key_values"


class RouterTap:
    """Captures the MoE input [T, H] and the top-k expert indices [T, k] at the router of one layer."""

    def __init__(self, moe_block):
        self.inputs: list[torch.Tensor] = []
        self.indices: list[torch.Tensor] = []
        self._handle = moe_block.gate.register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        self.inputs.append(args[0].detach())
        self.indices.append(output[2].detach())

    def pop(self) -> tuple[torch.Tensor, torch.Tensor]:
        x, idx = torch.cat(self.inputs), torch.cat(self.indices)
        self.inputs.clear()
        self.indices.clear()
        return x, idx

    def remove(self) -> None:
        self._handle.remove()


def accumulate_expert_stats(
    stats: ExpertStats,
    x: torch.Tensor,
    topk: torch.Tensor,
    experts,
    all_experts: bool,
    token_chunk: int = 8192,
) -> None:
    """Fold one batch of routed tokens into ``stats``; ``experts`` is the layer's Qwen3_5MoeExperts."""
    num_experts = experts.gate_up_proj.shape[0]
    stats.input_amax = torch.maximum(stats.input_amax, x.abs().amax().float().cpu())
    act = experts.act_fn
    if not all_experts:
        # sort the (token, slot) pairs by expert once, then slice per expert
        flat = topk.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token_of = order // topk.shape[1]
        counts = torch.bincount(flat, minlength=num_experts).cpu()
        offsets = [0, *torch.cumsum(counts, 0).tolist()]
    for e in range(num_experts):
        if all_experts:
            rows = None
            n = x.shape[0]
        else:
            n = int(counts[e])
            if n == 0:
                continue
            rows = token_of[offsets[e] : offsets[e + 1]]
        w = experts.gate_up_proj[e]
        for start in range(0, n, token_chunk):
            xe = x[start : start + token_chunk] if rows is None else x[rows[start : start + token_chunk]]
            hidden = expert_down_input(xe, w, act)
            in_amax, down_amax = xe.abs().amax().float(), hidden.abs().amax().float()
            if stats.gate_up_hessian is not None:
                xf, hf = xe.float(), hidden.float()
                stats.gate_up_hessian[e] += xf.T @ xf
                stats.down_hessian[e] += hf.T @ hf
            stats.gate_up_amax[e] = torch.maximum(stats.gate_up_amax[e], in_amax.cpu())
            stats.down_amax[e] = torch.maximum(stats.down_amax[e], down_amax.cpu())
        stats.num_tokens[e] += n


@torch.no_grad()
def calibrate_layer(
    layer,
    hidden: torch.Tensor,
    rotary,
    all_experts: bool = False,
    batch_size: int = 8,
    hessians: bool = False,
    kv_tap: KVTap | None = None,
) -> tuple[torch.Tensor, ExpertStats]:
    """Run ``hidden`` [B, S, H] (on the layer's device) through ``layer``; returns (output, expert stats),
    with each expert's input second moments when ``hessians`` (for GPTQ); ``kv_tap`` (a full-attention
    layer's) collects the amax of the keys and values it caches.

    The output comes from the unmodified layer (routing and gating untouched, also with ``all_experts``).
    """
    num_experts, two_i, h_dim = layer.mlp.experts.gate_up_proj.shape
    stats = ExpertStats.empty(num_experts)
    if hessians:
        dev = hidden.device
        stats.gate_up_hessian = torch.zeros(num_experts, h_dim, h_dim, device=dev)
        stats.down_hessian = torch.zeros(num_experts, two_i // 2, two_i // 2, device=dev)
    tap = RouterTap(layer.mlp)
    cache = {} if kv_tap is None else {_cache_kwarg(layer): kv_tap}

    def fold() -> None:
        x, topk = tap.pop()
        accumulate_expert_stats(stats, x, topk, layer.mlp.experts, all_experts)

    try:
        out = run_layer(layer, hidden, rotary, batch_size, cache, after_batch=fold)
    finally:
        tap.remove()
    return out, stats


@torch.no_grad()
def run_layer(layer, hidden: torch.Tensor, rotary, batch_size: int = 8, cache: dict | None = None,
              after_batch=None) -> torch.Tensor:  # fmt: skip
    """``layer``'s output for ``hidden`` [B, S, H], ``batch_size`` sequences per forward (causal, positions
    from 0); ``after_batch()`` is called after each forward (the calibration taps read their batch there)."""
    out = torch.empty_like(hidden)
    seq_len = hidden.shape[1]
    for start in range(0, hidden.shape[0], batch_size):
        h = hidden[start : start + batch_size]
        pos = torch.arange(seq_len, device=h.device).view(1, 1, -1).expand(3, h.shape[0], -1)
        cos_sin = rotary(h, pos)
        out[start : start + batch_size] = layer(
            h, position_embeddings=cos_sin, attention_mask=None, position_ids=pos[0], **(cache or {})
        )
        if after_batch is not None:
            after_batch()
    return out
