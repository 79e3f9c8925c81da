"""How far a model's next-token distributions are from a reference's, token by token: KL(ref ‖ model) over the
full vocabulary and whether both put the same token first. Used by ``fp4moe eval`` (the engine's log-probs),
the quick check against transformers (``reference_kl``) and the format search's sensitivity pass
(``quantize.sensitivity``); here, below both, so that quantize need not import eval."""

from __future__ import annotations

import torch


def token_kl(ref_logprobs: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """KL(ref ‖ model) per token [...] from log-probabilities [..., V] (fp32); never below zero (fp32
    rounding gives -1e-9 where the two agree)."""
    return (ref_logprobs.exp() * (ref_logprobs - logprobs)).sum(-1).clamp(min=0)


def top1_agrees(ref: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """Per token [...]: both put the same token first (logits or log-probabilities [..., V])."""
    return ref.argmax(-1) == other.argmax(-1)
