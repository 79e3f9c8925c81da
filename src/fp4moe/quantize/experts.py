"""NVFP4 of weights and of one MoE block's routed experts: block scales by a ``quantize.scales`` method, under
one global scale per matrix (gate and up of an expert share one, from the amax of both, since vLLM keeps only
the gate's), optionally through GPTQ error compensation (``quantize.gptq``). Input scales come from
calibration; experts that saw no calibration token take a fallback (``input_amax_with_fallback``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp4moe.formats import nvfp4
from fp4moe.quantize import gptq
from fp4moe.quantize.calibrate import ExpertStats
from fp4moe.quantize.scales import ScaleMethod, choose_block_scales


def quantize_weight(
    w: torch.Tensor,
    method: ScaleMethod = ScaleMethod.RTN,
    name: str = "tensor",
    global_scale: torch.Tensor | None = None,
    hessian: torch.Tensor | None = None,
) -> nvfp4.NVFP4Tensor:
    """NVFP4 of ``w`` [..., N, K] with block scales by ``method``, under ``global_scale`` (default: one RTN
    global scale per matrix; pass a shared one for shards that must agree); with ``hessian`` [..., K, K]
    (input second moments) through GPTQ error compensation (``quantize.gptq``)."""
    if method is ScaleMethod.RTN and hessian is None:
        return nvfp4.quantize(w, global_scale, name=name)
    nvfp4.check_quantizable(w, name)
    if global_scale is None:
        global_scale = nvfp4.global_scale_from_amax(w.abs().amax(dim=(-2, -1)))
    if hessian is not None:
        return gptq.gptq_quantize(w, hessian, global_scale, method)
    scales = choose_block_scales(w, global_scale, method)
    return nvfp4.NVFP4Tensor(nvfp4.quantize_with_scales(w, scales, global_scale), scales, global_scale)


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
def quantize_expert_weights(
    gate_up: torch.Tensor,
    down: torch.Tensor,
    stats: ExpertStats | None = None,
    method: ScaleMethod = ScaleMethod.RTN,
    name: str = "experts",
    expert_chunk: int = 4,
) -> tuple[nvfp4.NVFP4Tensor, nvfp4.NVFP4Tensor]:
    """NVFP4 of ``gate_up`` [E, 2I, H] and ``down`` [E, H, I] (any float dtype/device), ``expert_chunk``
    experts at a time so float32 temporaries stay small; results on the CPU. With Hessians in ``stats``
    (calibrated with ``hessians=True``), GPTQ error compensation under the same scale method."""
    num_experts = gate_up.shape[0]
    parts_gu, parts_d = [], []
    use_gptq = stats is not None and stats.gate_up_hessian is not None
    if use_gptq:  # GPTQ walks the columns in Python: batch more experts per walk
        expert_chunk = max(expert_chunk, 16)
    for start in range(0, num_experts, expert_chunk):
        chunk = slice(start, start + expert_chunk)
        gu, d = gate_up[chunk], down[chunk]
        h_gu = h_d = None
        if use_gptq:
            h_gu = gptq.hessian_or_identity(
                stats.gate_up_hessian[chunk].to(gu.device), stats.num_tokens[chunk]
            )
            h_d = gptq.hessian_or_identity(stats.down_hessian[chunk].to(d.device), stats.num_tokens[chunk])
        parts_gu.append(to_cpu(quantize_weight(gu, method, f"{name}[{start}:].gate_up_proj", hessian=h_gu)))
        parts_d.append(to_cpu(quantize_weight(d, method, f"{name}[{start}:].down_proj", hessian=h_d)))
    return _cat(parts_gu), _cat(parts_d)


@torch.no_grad()
def quantize_experts(
    gate_up: torch.Tensor,
    down: torch.Tensor,
    stats: ExpertStats,
    method: ScaleMethod = ScaleMethod.RTN,
    name: str = "experts",
    expert_chunk: int = 4,
) -> QuantizedExperts:
    """``quantize_expert_weights`` with the weight amax and the calibrated (or fallback) input amax the
    checkpoint stores beside them."""
    q_gu, q_d = quantize_expert_weights(gate_up, down, stats, method, name, expert_chunk)
    gu_amax = gate_up.abs().amax(dim=(-2, -1)).float().cpu()
    d_amax = down.abs().amax(dim=(-2, -1)).float().cpu()
    in_gu, in_d, fallback = input_amax_with_fallback(stats)
    return QuantizedExperts(q_gu, q_d, gu_amax, d_amax, in_gu, in_d, fallback)


def to_cpu(q: nvfp4.NVFP4Tensor) -> nvfp4.NVFP4Tensor:
    return nvfp4.NVFP4Tensor(q.packed.cpu(), q.block_scales.cpu(), q.global_scale.cpu())


def _cat(parts: list[nvfp4.NVFP4Tensor]) -> nvfp4.NVFP4Tensor:
    return nvfp4.NVFP4Tensor(
        torch.cat([p.packed for p in parts]),
        torch.cat([p.block_scales for p in parts]),
        torch.cat([p.global_scale for p in parts]),
    )
