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


# blocks per step of the search off the GPU: its float32 temporaries (512 KB each) stay in the CPU's cache
# rather than streaming through memory once per candidate (with the grid by bits: the quantize stage 3x
# faster on 2 cores, BENCHMARKS.md)
CPU_CHUNK_BLOCKS = 1 << 13


def _block_error(absx: torch.Tensor, eff: torch.Tensor) -> torch.Tensor:
    """Squared error of blocks of magnitudes ``absx`` [B, 16] under effective scales ``eff`` [B, 1] (the e4m3
    scale over the global scale): each |x| / eff rounded to the E2M1 grid (``nvfp4.e2m1_magnitude``), times
    eff, less |x|. Bit for bit the error of quantizing x itself (``quantize_with_scales``): the grid is
    symmetric, and dividing, clamping and subtracting treat both signs alike."""
    d = absx / eff
    d.clamp_(max=nvfp4.FP4_MAX)
    d = nvfp4.e2m1_magnitude(d)
    d *= eff
    d -= absx
    d *= d
    return d.sum(-1)


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
    """E4M3 block scales [..., N, K/16] of ``w`` [..., N, K] under ``global_scale`` [...] by ``method``: per
    block the candidate with the smallest squared error, the first (RTN's) on ties. Off the GPU the blocks go
    ``CPU_CHUNK_BLOCKS`` at a time through every candidate; the choice does not depend on the chunking."""
    absx = w.float().unflatten(-1, (w.shape[-1] // nvfp4.BLOCK_SIZE, nvfp4.BLOCK_SIZE)).abs()
    amax = absx.amax(-1)
    candidates = _candidates(amax, global_scale, method)
    if len(candidates) == 1:
        return candidates[0]
    codes = torch.stack([c.view(torch.uint8) for c in candidates])  # [C, ..., N, K/16]
    gs = global_scale.float().reshape(*global_scale.shape, 1, 1)
    effs = (codes.view(nvfp4.FP8_DTYPE).float() / gs).reshape(len(candidates), -1, 1)  # [C, blocks, 1]
    codes, absx = codes.reshape(len(candidates), -1), absx.reshape(-1, nvfp4.BLOCK_SIZE)
    best = torch.empty_like(codes[0])
    step = max(absx.shape[0], 1) if absx.is_cuda else CPU_CHUNK_BLOCKS  # an empty w: no step, no error
    for b in range(0, absx.shape[0], step):
        part = slice(b, b + step)
        chosen, least = codes[0, part], _block_error(absx[part], effs[0, part])
        for c in range(1, len(candidates)):
            err = _block_error(absx[part], effs[c, part])
            better = err < least  # strict: RTN's scale wins ties
            chosen, least = torch.where(better, codes[c, part], chosen), torch.where(better, err, least)
        best[part] = chosen
    return best.view(nvfp4.FP8_DTYPE).reshape(amax.shape)
