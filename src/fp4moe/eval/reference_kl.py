"""Quick quality check of a quantized checkpoint against its bf16 source, with transformers as the model:
mean and max per-token KL(ref || quantized) over the full vocabulary, and top-1 agreement."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from fp4moe.layers.divergence import token_kl, top1_agrees
from fp4moe.quantize.dequant import dequantized_state_dict


@dataclass
class KLResult:
    mean_kl: float
    max_kl: float
    top1_agreement: float
    num_tokens: int


def load_reference_model(path: str | Path, dtype=torch.float32):
    from transformers import Qwen3_5MoeForConditionalGeneration

    model = Qwen3_5MoeForConditionalGeneration.from_pretrained(str(path), dtype=dtype)
    return model.eval()


@torch.no_grad()
def logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=input_ids).logits.float()  # [B, S, V]


def kl_stats(ref_logits: torch.Tensor, logits_q: torch.Tensor) -> KLResult:
    kl = token_kl(F.log_softmax(ref_logits, dim=-1), F.log_softmax(logits_q, dim=-1)).flatten()
    top1 = top1_agrees(ref_logits, logits_q).float().mean()
    return KLResult(float(kl.mean()), float(kl.max()), float(top1), kl.numel())


@torch.no_grad()
def compare_with_reference(quantized: str | Path, reference: str | Path, input_ids: torch.Tensor) -> KLResult:
    """KL of transformers running the dequantized experts vs transformers running the bf16 source."""
    model = load_reference_model(reference)
    ref = logits(model, input_ids)
    model.load_state_dict(dequantized_state_dict(quantized), strict=True)
    return kl_stats(ref, logits(model, input_ids))
