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
Applying them to a layer's experts (with GPTQ where asked) is ``quantize.experts``.
"""

from __future__ import annotations

import enum

import torch

from fp4moe.formats import nvfp4


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
