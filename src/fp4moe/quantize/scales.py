"""How the NVFP4 scales of routed experts are chosen.

- ``rtn`` (round-to-nearest): the global scale from the weight amax, each block scale from the block amax
  (the block max maps to 6), codes rounded half-to-even: what ModelOpt and llm-compressor produce.
- ``4over6``: per block, the block max maps to 6 or to 4 (scale amax/4: the values near the max land on the
  finer part of the E2M1 grid), whichever gives the smaller block squared error.
- ``mse``: per block, the e4m3 scale with the smallest block squared error among RTN's scale, its e4m3
  neighbours (6 below, 6 above) and the 4-over-6 scale.
Every method keeps RTN's global scale and chooses among candidates that include RTN's own block scale,
keeping it on ties, so no block's error exceeds RTN's. Gate and up of one expert share one global scale
(from the amax of both, since vLLM keeps only the gate's). The default, ``mse``, was chosen by eval KL on
the trained reference model (issue 7, BENCHMARKS.md). ``--gptq`` adds GPTQ error compensation for the
routed experts on top of any of them (``quantize.gptq``).
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
    FOUR_OVER_SIX = "4over6"
    MSE = "mse"


NEIGHBOURS = 6  # e4m3 steps searched on each side of RTN's block scale by ``mse``


def _block_error(blocks: torch.Tensor, scales: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    """Squared error of each block [..., N, K/16, 16] quantized under e4m3 ``scales`` [..., N, K/16]."""
    eff = scales.float().unsqueeze(-1) / gs
    codes = nvfp4.e2m1_codes(torch.clamp(blocks / eff, -nvfp4.FP4_MAX, nvfp4.FP4_MAX))
    return ((nvfp4.e2m1_values(codes) * eff - blocks) ** 2).sum(-1)


def _candidates(amax: torch.Tensor, global_scale: torch.Tensor, method: ScaleMethod) -> list[torch.Tensor]:
    """Candidate e4m3 block scales [..., N, K/16], RTN's first."""
    rtn = nvfp4.block_scales_from_amax(amax, global_scale)
    out = [rtn]
    if method in (ScaleMethod.FOUR_OVER_SIX, ScaleMethod.MSE):
        out.append(nvfp4.block_scales_from_amax(amax * (nvfp4.FP4_MAX / 4.0), global_scale))
    if method is ScaleMethod.MSE:
        bits = rtn.view(torch.uint8).to(torch.int16)
        for step in [*range(-NEIGHBOURS, 0), *range(1, NEIGHBOURS + 1)]:
            # positive e4m3 values are ordered like their bit patterns; 0x01..0x7E are finite and nonzero
            out.append(torch.clamp(bits + step, 1, 0x7E).to(torch.uint8).view(nvfp4.FP8_DTYPE))
    return out


def choose_block_scales(w: torch.Tensor, global_scale: torch.Tensor, method: ScaleMethod) -> torch.Tensor:
    """E4M3 block scales [..., N, K/16] of ``w`` [..., N, K] under ``global_scale`` [...] by ``method``."""
    blocks = w.float().unflatten(-1, (w.shape[-1] // nvfp4.BLOCK_SIZE, nvfp4.BLOCK_SIZE))
    amax = blocks.abs().amax(-1)
    gs = global_scale.float().reshape(*global_scale.shape, 1, 1, 1)
    candidates = _candidates(amax, global_scale, method)
    best = candidates[0]
    if len(candidates) == 1:
        return best
    best_err = _block_error(blocks, best, gs)
    for cand in candidates[1:]:
        err = _block_error(blocks, cand, gs)
        better = err < best_err  # strict: RTN's scale wins ties
        best = torch.where(better, cand.view(torch.uint8), best.view(torch.uint8)).view(nvfp4.FP8_DTYPE)
        best_err = torch.where(better, err, best_err)
    return best


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
        from fp4moe.quantize.gptq import gptq_quantize

        return gptq_quantize(w, hessian, global_scale, method)
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
def quantize_experts(
    gate_up: torch.Tensor,
    down: torch.Tensor,
    stats: ExpertStats,
    method: ScaleMethod = ScaleMethod.RTN,
    name: str = "experts",
    expert_chunk: int = 4,
) -> QuantizedExperts:
    """NVFP4 of ``gate_up`` [E, 2I, H] and ``down`` [E, H, I] (any float dtype/device), ``expert_chunk``
    experts at a time so float32 temporaries stay small; results on the CPU. With Hessians in ``stats``
    (calibrated with ``hessians=True``), GPTQ error compensation under the same scale method."""
    from fp4moe.quantize.gptq import hessian_or_identity

    num_experts = gate_up.shape[0]
    parts_gu, parts_d = [], []
    gptq = stats.gate_up_hessian is not None
    if gptq:  # GPTQ walks the columns in Python: batch more experts per walk
        expert_chunk = max(expert_chunk, 16)
    for start in range(0, num_experts, expert_chunk):
        chunk = slice(start, start + expert_chunk)
        gu, d = gate_up[chunk], down[chunk]
        h_gu = h_d = None
        if gptq:
            h_gu = hessian_or_identity(stats.gate_up_hessian[chunk].to(gu.device), stats.num_tokens[chunk])
            h_d = hessian_or_identity(stats.down_hessian[chunk].to(d.device), stats.num_tokens[chunk])
        parts_gu.append(to_cpu(quantize_weight(gu, method, f"{name}[{start}:].gate_up_proj", hessian=h_gu)))
        parts_d.append(to_cpu(quantize_weight(d, method, f"{name}[{start}:].down_proj", hessian=h_d)))
    gu_amax = gate_up.abs().amax(dim=(-2, -1)).float().cpu()
    d_amax = down.abs().amax(dim=(-2, -1)).float().cpu()
    in_gu, in_d, fallback = input_amax_with_fallback(stats)
    return QuantizedExperts(_cat(parts_gu), _cat(parts_d), gu_amax, d_amax, in_gu, in_d, fallback)


def to_cpu(q: nvfp4.NVFP4Tensor) -> nvfp4.NVFP4Tensor:
    return nvfp4.NVFP4Tensor(q.packed.cpu(), q.block_scales.cpu(), q.global_scale.cpu())


def _cat(parts: list[nvfp4.NVFP4Tensor]) -> nvfp4.NVFP4Tensor:
    return nvfp4.NVFP4Tensor(
        torch.cat([p.packed for p in parts]),
        torch.cat([p.block_scales for p in parts]),
        torch.cat([p.global_scale for p in parts]),
    )
