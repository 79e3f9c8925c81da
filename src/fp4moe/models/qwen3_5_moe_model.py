"""The qwen3_5_moe text model as torch modules of our engine (no transformers in the serving path).

The forward takes a flat token batch -- ``input_ids`` [T] of several sequences back to back, ``positions``
[3, T] (mRoPE T/H/W; equal rows for text) -- and a per-step context (``fp4moe.engine.reference.context``) that says
where each sequence starts, how many of its tokens are cached, and which cache/state slot it owns.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from fp4moe.layers.attention import GatedAttention
from fp4moe.layers.deltanet import GatedDeltaNet
from fp4moe.layers.linear import Linear
from fp4moe.layers.moe import SparseMoE
from fp4moe.layers.norm import RMSNorm
from fp4moe.layers.rope import Rotary
from fp4moe.models.qwen3_5_moe import ModelArgs


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.is_attention = args.layer_types[layer_id] == "full_attention"
        if self.is_attention:
            self.self_attn = GatedAttention(
                args.hidden_size, args.num_heads, args.num_kv_heads, args.head_dim, args.eps, layer_id
            )
        else:
            self.linear_attn = GatedDeltaNet(
                args.hidden_size,
                args.linear_num_key_heads,
                args.linear_num_value_heads,
                args.linear_key_head_dim,
                args.linear_value_head_dim,
                args.conv_kernel,
                args.eps,
                layer_id,
            )
        self.mlp = SparseMoE(
            args.hidden_size,
            args.num_experts,
            args.top_k,
            args.moe_intermediate_size,
            args.shared_intermediate_size,
        )
        self.input_layernorm = RMSNorm(args.hidden_size, args.eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.eps)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx) -> torch.Tensor:
        x = self.input_layernorm(h)
        h = h + (self.self_attn(x, cos, sin, ctx) if self.is_attention else self.linear_attn(x, ctx))
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen3_5MoeModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Parameter(torch.empty(args.vocab_size, args.hidden_size), requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.eps)
        self.lm_head = Linear(args.hidden_size, args.vocab_size)
        self.rotary: Rotary | None = None
        self.mtp = None  # an MTPHead when the checkpoint has mtp.* tensors (set by the loader)
        # the checkpoint's fp8 KV-cache scales by layer, (k, v) float32 0-D (set by the loader; engine.loading.kv_scales)
        self.kv_scales: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens[input_ids]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx, inputs_embeds: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] of a flat batch."""
        if self.rotary is None:
            self.rotary = Rotary(self.args.rope, self.embed_tokens.device)
        h = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        cos, sin = self.rotary.cos_sin(positions, h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin, ctx)
        return self.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


class MTPHead(nn.Module):
    """The checkpoint's multi-token-prediction head (``mtp.*``), as vLLM's qwen3_5_mtp runs it:
    h' = fc(concat(pre_fc_norm_embedding(embed(x_{t+1})), pre_fc_norm_hidden(h_t))) -> one full-attention
    decoder layer with its own MoE (and its own KV cache) -> norm; the target's lm_head turns h' into logits for
    token t+2. The embedding and lm_head are the target's (``mtp_use_dedicated_embeddings: false``). h_t is the
    target's output after its final norm, and the layer's rotary position is t -- the position of h_t, not of
    x_{t+1} -- as vLLM's MTP proposer runs it (it shifts the input ids left and keeps the target's positions)."""

    def __init__(self, args):
        super().__init__()
        h = args.hidden_size
        self.layer_id = args.num_layers  # its KV lives beside the target's under this layer id
        self.fc = Linear(2 * h, h)
        self.pre_fc_norm_embedding = RMSNorm(h, args.eps)
        self.pre_fc_norm_hidden = RMSNorm(h, args.eps)
        self.norm = RMSNorm(h, args.eps)
        mtp_args = dataclasses.replace(args, layer_types=(*args.layer_types, "full_attention"))
        self.layer = DecoderLayer(mtp_args, self.layer_id)
        # a draft vocabulary (``use_draft_vocab``): its ids and the lm_head's rows for them
        self.draft_ids: torch.Tensor | None = None
        self.draft_head: Linear | None = None

    def use_draft_vocab(self, model, ids: torch.Tensor | None) -> None:
        """Draft from the token ``ids`` alone (``engine.spec.draft_vocab``): their rows of the target's lm_head
        (None: the whole vocabulary again)."""
        if ids is None:
            self.draft_ids = self.draft_head = None
            return
        self.draft_ids = ids.to(model.embed_tokens.device)
        self.draft_head = model.lm_head.rows(self.draft_ids)

    def logits(self, model, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits [T, V] of the head's states h': the target's lm_head, or with a draft vocabulary its
        rows for those ids and -inf elsewhere (so every sampler and acceptance test sees a full-width row)."""
        if self.draft_head is None:
            return model.lm_head(hidden)
        out = hidden.new_full((hidden.shape[0], model.args.vocab_size), float("-inf"))
        out[:, self.draft_ids] = self.draft_head(hidden).to(out.dtype)
        return out

    def greedy(self, model, hidden: torch.Tensor) -> torch.Tensor:
        """The argmax of ``logits`` [T] (the lowest id among ties), without the full-width row."""
        if self.draft_head is None:
            return model.lm_head(hidden).argmax(-1)
        return self.draft_ids[self.draft_head(hidden).argmax(-1)]

    def forward(
        self, model, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, ctx
    ) -> torch.Tensor:
        """input_ids [T] (the tokens after each hidden state), hidden [T, H] (target or own), positions of
        the hidden states -> h' [T, H]."""
        e = self.pre_fc_norm_embedding(model.embed(input_ids))
        x = self.fc(torch.cat([e, self.pre_fc_norm_hidden(hidden)], dim=-1))
        cos, sin = model.rotary.cos_sin(positions, x.dtype)
        return self.norm(self.layer(x, cos, sin, ctx))
