"""Sparse MoE block: fp32-softmax router with renormalised top-k, SwiGLU routed experts (dense or NVFP4,
kept packed), and a shared expert gated by sigmoid(shared_expert_gate(x)).

Tokens are sorted by expert once and each expert runs one matmul over its tokens; NVFP4 experts are
dequantized one expert at a time with the torch reference (the CPU path)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fp4moe.formats import nvfp4
from fp4moe.layers.linear import Linear


class RoutedExperts(nn.Module):
    """E experts: gate_up [E, 2I, H] (gate rows first) and down [E, H, I], dense or NVFP4."""

    def __init__(self, num_experts: int, hidden: int, inter: int):
        super().__init__()
        self.num_experts, self.hidden, self.inter = num_experts, hidden, inter
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter), requires_grad=False)
        self.quantized = False
        self.tile = 0  # NVFP4 bytes in ``kernels.expert_layout``'s order at this step (0: the checkpoint's)

    def use_nvfp4(self) -> None:
        """Hold packed NVFP4 weights instead (set before loading)."""
        e, h, i = self.num_experts, self.hidden, self.inter
        del self.gate_up_proj, self.down_proj
        self.gate_up_proj = self.down_proj = None
        self.register_buffer("gate_up_packed", torch.empty(e, 2 * i, h // 2, dtype=torch.uint8))
        self.register_buffer("gate_up_scales", torch.empty(e, 2 * i, h // 16, dtype=nvfp4.FP8_DTYPE))
        self.register_buffer("gate_up_decode", torch.empty(e, 2, dtype=torch.float32))  # gate, up
        self.register_buffer("down_packed", torch.empty(e, h, i // 2, dtype=torch.uint8))
        self.register_buffer("down_scales", torch.empty(e, h, i // 16, dtype=nvfp4.FP8_DTYPE))
        self.register_buffer("down_decode", torch.empty(e, dtype=torch.float32))
        self.quantized = True

    def tile_for_kernels(self, step: int) -> None:
        """Reorder the NVFP4 bytes in place into ``kernels.expert_layout``'s tiles at ``step``-byte steps (the
        GPU kernels' fastest order; ``kernel_weights`` says which), one tensor at a time."""
        if not self.quantized or self.tile:
            raise ValueError("only row-major NVFP4 experts are tiled")
        self._reorder(step, True)

    def untile(self) -> None:
        """``tile_for_kernels`` undone: the checkpoint's row-major order again (for comparisons)."""
        if not self.tile:
            raise ValueError("the experts are row-major already")
        self._reorder(self.tile, False)

    def _reorder(self, step: int, tiled: bool) -> None:
        from fp4moe.kernels.expert_layout import tile_experts, untile_experts

        reorder = tile_experts if tiled else untile_experts
        for name, gated in (("gate_up", True), ("down", False)):
            packed, scales = reorder(
                getattr(self, f"{name}_packed"), getattr(self, f"{name}_scales"), step, gated
            )
            setattr(self, f"{name}_packed", packed)
            setattr(self, f"{name}_scales", scales)
        self.tile = step if tiled else 0

    def _row_major(self, name: str, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert ``e``'s codes and block scales of ``name`` (gate_up, down) in the checkpoint's order."""
        packed, scales = (
            getattr(self, f"{name}_packed")[e : e + 1],
            getattr(self, f"{name}_scales")[e : e + 1],
        )
        if self.tile:
            from fp4moe.kernels.expert_layout import untile_experts

            packed, scales = untile_experts(packed, scales, self.tile, name == "gate_up")
        return packed[0], scales[0]

    def weights(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.quantized:
            return self.gate_up_proj[e], self.down_proj[e]
        i = self.inter  # gate and up may carry different decode scales (kept exact, unlike vLLM)
        gu_packed, gu_scales = self._row_major("gate_up", e)
        gate_up = torch.cat(
            [
                nvfp4.dequantize_modelopt(gu_packed[:i], gu_scales[:i], self.gate_up_decode[e, 0], dtype),
                nvfp4.dequantize_modelopt(gu_packed[i:], gu_scales[i:], self.gate_up_decode[e, 1], dtype),
            ]
        )
        dn_packed, dn_scales = self._row_major("down", e)
        down = nvfp4.dequantize_modelopt(dn_packed, dn_scales, self.down_decode[e], dtype)
        return gate_up, down

    def kernel_weights(self):
        """The weights as the GPU kernels take them (``kernels.moe_dispatch.ExpertWeights``); bf16 experts
        get decode scales of 1, made once per device."""
        from fp4moe.kernels.moe_dispatch import ExpertWeights

        if self.quantized:
            return ExpertWeights(
                (self.gate_up_packed, self.gate_up_scales, self.gate_up_decode),
                (self.down_packed, self.down_scales, self.down_decode),
                self.tile,
            )
        if getattr(self, "_ones", None) is None or self._ones[0].device != self.gate_up_proj.device:
            dev = self.gate_up_proj.device
            self._ones = (
                torch.ones(self.num_experts, 2, device=dev),
                torch.ones(self.num_experts, device=dev),
            )
        return ExpertWeights(
            (self.gate_up_proj, self.gate_up_proj, self._ones[0]),
            (self.down_proj, self.down_proj, self._ones[1]),
        )

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], topk_ids/weights [T, k] -> sum_k w * down(silu(gate x) * up x), [T, H]."""
        if x.is_cuda and x.dtype == torch.bfloat16:  # grouped Triton kernels, weights kept packed
            from fp4moe.kernels.moe_dispatch import moe_experts

            return moe_experts(self.kernel_weights(), x, topk_ids, topk_weights).to(x.dtype)
        out = torch.zeros_like(x)
        flat = topk_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        token_of, slot_of = order // topk_ids.shape[1], order % topk_ids.shape[1]
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            tokens, slots = token_of[start : start + n], slot_of[start : start + n]
            start += n
            gate_up, down = self.weights(e, x.dtype)
            gate, up = F.linear(x[tokens], gate_up).chunk(2, dim=-1)  # [n, I] each
            y = F.linear(F.silu(gate) * up, down) * topk_weights[tokens, slots, None]
            out.index_add_(0, tokens, y.to(out.dtype))
        return out


class SparseMoE(nn.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int, inter: int, shared_inter: int):
        super().__init__()
        self.top_k = top_k
        self.gate = Linear(hidden, num_experts)  # the router
        self.experts = RoutedExperts(num_experts, hidden, inter)
        self.shared_gate_proj = Linear(hidden, shared_inter)
        self.shared_up_proj = Linear(hidden, shared_inter)
        self.shared_down_proj = Linear(shared_inter, hidden)
        self.shared_expert_gate = Linear(hidden, 1)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.gate(x)  # [T, E]
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        return ids, weights.to(logits.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        routed = self.experts(x, ids, weights)
        shared = self.shared_down_proj(F.silu(self.shared_gate_proj(x)) * self.shared_up_proj(x))
        return routed + torch.sigmoid(self.shared_expert_gate(x)) * shared
