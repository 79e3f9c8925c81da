"""The checkpoint's multi-token-prediction head (``mtp.*``), as vLLM's qwen3_5_mtp runs it:
h' = fc(concat(pre_fc_norm_embedding(embed(x_{t+1})), pre_fc_norm_hidden(h_t))) -> one full-attention
decoder layer with its own MoE (and its own KV cache) -> norm; the target's lm_head turns h' into logits for
token t+2. The embedding and lm_head are the target's (``mtp_use_dedicated_embeddings: false``). h_t is the
target's output after its final norm, and the layer's rotary position is t -- the position of h_t, not of
x_{t+1} -- as vLLM's MTP proposer runs it (it shifts the input ids left and keeps the target's positions)."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from fp4moe.layers.linear import Linear
from fp4moe.layers.norm import RMSNorm


class MTPHead(nn.Module):
    def __init__(self, args):
        super().__init__()
        from fp4moe.models.qwen3_5_moe_model import DecoderLayer

        h = args.hidden_size
        self.layer_id = args.num_layers  # its KV lives beside the target's under this layer id
        self.fc = Linear(2 * h, h)
        self.pre_fc_norm_embedding = RMSNorm(h, args.eps)
        self.pre_fc_norm_hidden = RMSNorm(h, args.eps)
        self.norm = RMSNorm(h, args.eps)
        mtp_args = dataclasses.replace(args, layer_types=(*args.layer_types, "full_attention"))
        self.layer = DecoderLayer(mtp_args, self.layer_id)

    def forward(
        self, model, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, ctx
    ) -> torch.Tensor:
        """input_ids [T] (the tokens after each hidden state), hidden [T, H] (target or own), positions of
        the hidden states -> h' [T, H]."""
        e = self.pre_fc_norm_embedding(model.embed(input_ids))
        x = self.fc(torch.cat([e, self.pre_fc_norm_hidden(hidden)], dim=-1))
        cos, sin = model.rotary.cos_sin(positions, x.dtype)
        return self.norm(self.layer(x, cos, sin, ctx))
