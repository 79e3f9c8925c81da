"""How the NVFP4 scales of routed experts are chosen.

Implemented: round-to-nearest (``rtn``) -- the global scale from the weight amax, each block scale from
the block amax, codes rounded half-to-even: what ModelOpt and llm-compressor produce by default. Gate and
up of one expert share one global scale (from the amax of both, since vLLM keeps only the gate's).
Input scales come from calibration; experts that saw no calibration token take a fallback (see
``input_amax_with_fallback``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from fp4moe.formats import nvfp4
from fp4moe.quantize.calibrate import ExpertStats


class ScaleMethod(enum.Enum):
    RTN = "rtn"


@dataclass
class QuantizedExperts:
    """One MoE block's routed experts in NVFP4; leading dim E everywhere."""

    gate_up: nvfp4.NVFP4Tensor  # [E, 2I, H/2] packed, gate rows first
    down: nvfp4.NVFP4Tensor  # [E, H, I/2]
    gate_up_amax: torch.Tensor  # [E] weight amax of gate and up together
    down_amax: torch.Tensor  # [E]
    gate_up_input_amax: torch.Tensor  # [E] activation amax (after fallback)
    down_input_amax: torch.Tensor  # [E]
    fallback: torch.Tensor  # [E] bool: no calibration token reached this expert

    @property
    def intermediate_size(self) -> int:
        return self.gate_up.packed.shape[1] // 2


def input_amax_with_fallback(stats: ExpertStats) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-expert (gate/up input amax, down input amax, fallback mask).

    Fallback for experts with no calibration tokens: gate/up input -> the amax of the MoE input over all
    calibration tokens (every expert's input is a subset of those tokens, so this bounds it); down input
    -> the largest down-input amax among the layer's calibrated experts.
    """
    fallback = ~stats.calibrated
    if fallback.all():
        raise ValueError("no routed expert of this layer received a calibration token")
    gate_up = torch.where(fallback, stats.input_amax.expand_as(stats.gate_up_amax), stats.gate_up_amax)
    down = torch.where(
        fallback, stats.down_amax[stats.calibrated].max().expand_as(stats.down_amax), stats.down_amax
    )
    return gate_up, down, fallback


@torch.no_grad()
def quantize_experts(
    gate_up: torch.Tensor,
    down: torch.Tensor,
    stats: ExpertStats,
    method: ScaleMethod = ScaleMethod.RTN,
    name: str = "experts",
    expert_chunk: int = 4,
) -> QuantizedExperts:
    """NVFP4 of ``gate_up`` [E, 2I, H] and ``down`` [E, H, I] (any float dtype/device), ``expert_chunk``
    experts at a time so float32 temporaries stay small; results on the CPU."""
    if method is not ScaleMethod.RTN:
        raise NotImplementedError(f"scale method {method.value} is not implemented")
    num_experts = gate_up.shape[0]
    parts_gu, parts_d = [], []
    for start in range(0, num_experts, expert_chunk):
        gu = gate_up[start : start + expert_chunk]
        d = down[start : start + expert_chunk]
        parts_gu.append(_to_cpu(nvfp4.quantize(gu, name=f"{name}[{start}:].gate_up_proj")))
        parts_d.append(_to_cpu(nvfp4.quantize(d, name=f"{name}[{start}:].down_proj")))
    gu_amax = gate_up.abs().amax(dim=(-2, -1)).float().cpu()
    d_amax = down.abs().amax(dim=(-2, -1)).float().cpu()
    in_gu, in_d, fallback = input_amax_with_fallback(stats)
    return QuantizedExperts(_cat(parts_gu), _cat(parts_d), gu_amax, d_amax, in_gu, in_d, fallback)


def _to_cpu(q: nvfp4.NVFP4Tensor) -> nvfp4.NVFP4Tensor:
    return nvfp4.NVFP4Tensor(q.packed.cpu(), q.block_scales.cpu(), q.global_scale.cpu())


def _cat(parts: list[nvfp4.NVFP4Tensor]) -> nvfp4.NVFP4Tensor:
    return nvfp4.NVFP4Tensor(
        torch.cat([p.packed for p in parts]),
        torch.cat([p.block_scales for p in parts]),
        torch.cat([p.global_scale for p in parts]),
    )
