"""The routed experts of one MoE layer on the GPU: which kernels run them at a step's token count.

Up to ``GEMV_MAX_TOKENS`` tokens every (token, expert) pair runs as GEMVs (``nvfp4_gemv``; the down one on the
tensor cores over pairs, ``nvfp4_mma_gemv``); up to ``MMA_GEMV_MAX_TOKENS`` the tensor-core GEMVs over blocks
of up to 8 tokens of an expert; past that the grouped GEMMs over row blocks of 16-128 pairs of an expert
(``nvfp4_gemm``, whose prefill-sized blocks run ``nvfp4_moe_prefill``'s kernel, or with ``WGMMA_PREFILL`` on sm90
``nvfp4_wgmma``'s). The dispatch takes the
weights as tensors (``ExpertWeights``), never the torch module. Reference: ``nvfp4_gemm.moe_reference``."""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch

from fp4moe.kernels import INTERPRET, gpu_arch
from fp4moe.kernels import nvfp4_dequant as dq
from fp4moe.kernels import nvfp4_gemm as gemm
from fp4moe.kernels import nvfp4_moe_prefill as prefill
from fp4moe.kernels.moe_routing import PAIR_ROUTING_MAX_TOKENS, align, pair_routing


class ExpertWeights(NamedTuple):
    """One layer's routed experts as the kernels take them: gate/up and down, each (weights, block scales,
    decode scales). NVFP4: packed codes [E, 2I, H/2] / [E, H, I/2] uint8, FP8-E4M3 block scales
    [E, 2I, H/16] / [E, H, I/16], decode scales [E, 2] (gate, up) / [E] fp32. bf16 experts: the weights
    [E, 2I, H] / [E, H, I] in both of the first two places and decode scales of 1. ``tile``: the NVFP4 bytes'
    order (``expert_layout``: 0 row-major as in the checkpoint, else tiled at that many bytes a step)."""

    gate_up: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    down: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    tile: int = 0

    @property
    def quantized(self) -> bool:
        return self.gate_up[0].dtype == torch.uint8

    @property
    def num_experts(self) -> int:
        return self.gate_up[0].shape[0]

    @property
    def inter(self) -> int:
        return self.gate_up[0].shape[1] // 2


def moe_experts(experts: ExpertWeights, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor):
    """sum_k w * down(silu(gate x) * up x) [T, H] in fp32 (``layers.moe.RoutedExperts`` on the GPU)."""
    t, k = topk_ids.shape
    return moe_pairs(experts, x, topk_ids, topk_weights).view(t, k, -1).sum(1, dtype=torch.float32)


# up to this many tokens, every (token, expert) pair runs as GEMVs (nvfp4_gemv); FP4MOE_GEMV_MAX_TOKENS for
# benchmarks (benchmarks/spec_decode.py: a batch-1 verification's 3 tokens on the tensor-core GEMVs)
GEMV_MAX_TOKENS = int(os.environ.get("FP4MOE_GEMV_MAX_TOKENS", "4"))
# from GEMV_MAX_TOKENS + 1 up to this many tokens, NVFP4 experts run as tensor-core GEMVs in blocks of up to 8
# tokens of an expert (nvfp4_mma_gemv; sm89+, not under the interpreter). H200, full-size experts per layer
# (benchmarks/tune/tune_experts.py): 50 + 29 us at 16 tokens against the grouped GEMM's 81 + 43, 101 + 58 at 64
# against 156 + 87; at 1 token 7.9 + 4.4 against the CUDA-core GEMV's 7.7 + 5.1, and in the captured step
# 0-4% slower than the GEMV, so those keep the one-token kernels. 0 turns every tensor-core GEMV off.
MMA_GEMV_MAX_TOKENS = int(os.environ.get("FP4MOE_MMA_GEMV_MAX_TOKENS", "128"))


# FP4MOE_WGMMA_PREFILL=1: prefill-sized blocks (64 or 128 pairs) on an sm90 GPU run ``nvfp4_wgmma``'s Hopper kernels
# (the dequantized weights as wgmma's register operand, K reordered). Off by default: built and compiled for sm90
# without a GPU (2026-12-04), not yet measured or run on one (benchmarks/tune/tune_prefill_experts.py --wgmma)
WGMMA_PREFILL = os.environ.get("FP4MOE_WGMMA_PREFILL", "0") == "1"


# up to GEMV_MAX_TOKENS tokens: the CUDA-core gate/up GEMV, then the tensor-core down (pairs, wk 2, kc 64): H200,
# batch-1 step 1.4% faster (benchmarks/tune/tune_decode.py; the down launch alone 4.4 against 5.1 us per layer). Needs
# int32 contiguous ids (the router kernel's): its programs read them before they wait, so no copy may be in flight
ONE_TOKEN_MMA_DOWN = True


@functools.cache
def _have_gluon() -> bool:
    """Whether this Triton has the Gluon API the tensor-core GEMVs use (3.6: linear layouts, trivial-conversion
    checks; ``pip install '.[gpu]'`` allows older Tritons, which then keep the Triton kernels)."""
    import triton

    if tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 6):
        return False
    try:
        from fp4moe.kernels import nvfp4_mma_gemv  # noqa: F401
    except (ImportError, AttributeError):
        return False
    return True


def _tensor_cores_take(experts: ExpertWeights, device: torch.device) -> bool:
    """Whether the tensor-core GEMVs can run these experts on ``device``: NVFP4 with mode 7's dequantization,
    an NVIDIA GPU that converts e4m3 (sm89+, ``gpu_arch.has_fp8``), Triton with Gluon, not the interpreter."""
    return (
        experts.quantized
        and not INTERPRET
        and device.type == "cuda"
        and dq.DEQUANT_MODE == 7
        and gpu_arch.has_fp8(device)
        and _have_gluon()
    )


def _mma_gemv_fits(experts: ExpertWeights, x: torch.Tensor, one_token: bool = False) -> bool:
    if not (
        MMA_GEMV_MAX_TOKENS > 0
        and (one_token or GEMV_MAX_TOKENS < x.shape[0] <= MMA_GEMV_MAX_TOKENS)
        and _tensor_cores_take(experts, x.device)
    ):
        return False
    from fp4moe.kernels import nvfp4_mma_gemv as mma

    return mma.fits(x.shape[1], experts.inter)


def _wgmma_fits(experts: ExpertWeights, x: torch.Tensor, bm: int) -> bool:
    """Whether ``nvfp4_wgmma``'s kernels take this launch: switched on (``WGMMA_PREFILL``), blocks of 64 or 128
    pairs, the tensor-core GEMVs' conditions, an sm90 GPU (wgmma is Hopper's) and shapes it tiles."""
    if not (WGMMA_PREFILL and bm in (64, 128) and _tensor_cores_take(experts, x.device)):
        return False
    if torch.cuda.get_device_capability(x.device) != (9, 0):
        return False
    from fp4moe.kernels import nvfp4_wgmma as wg

    return wg.fits(x.shape[1], experts.inter, experts.tile)


def wants_k_order(experts: ExpertWeights, x: torch.Tensor, top_k: int) -> bool:
    """Whether ``moe_pairs`` will run these rows through ``nvfp4_wgmma`` (which takes its input in ``k_order``'s
    order: the norm ahead of the MoE can write it, ``moe_pairs(..., x_k=...)``)."""
    if not WGMMA_PREFILL or not experts.quantized or _mma_gemv_fits(experts, x):
        return False  # (the tensor-core GEMVs take their row counts first)
    bm = gemm.block_m(x.shape[0], top_k, experts.num_experts, _weights_first(experts, x))
    return _wgmma_fits(experts, x, bm)


def _weights_first(experts: ExpertWeights, x: torch.Tensor) -> bool:
    """Whether the weights-first prefill kernel takes both launches (K a multiple of its tile): 128-row blocks."""
    return (
        dq.mode_of(experts.gate_up[0]) in prefill.MODES and x.shape[1] % 32 == 0 and experts.inter % 32 == 0
    )


def tile_step(experts: ExpertWeights) -> int:
    """The ``expert_layout`` step these experts should be tiled at on their device: where the tensor-core GEMVs
    run them (NVFP4, mode 7, sm89+, Gluon) and the shapes tile; else 0 (row-major)."""
    from fp4moe.kernels import expert_layout

    gu = experts.gate_up[0]
    if not (expert_layout.ENABLED and experts.tile == 0 and _tensor_cores_take(experts, gu.device)):
        return 0
    return expert_layout.step_for(gu.shape[2] * 2, experts.inter)


def moe_pairs(experts: ExpertWeights, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
              x_k: torch.Tensor | None = None):  # fmt: skip
    """Each (token, expert) pair's weighted output [T*k, H] bf16 (pair = token * k + j). ``x_k``: x in
    ``k_order``'s order, where ``wants_k_order`` (else made here when ``nvfp4_wgmma`` runs)."""
    t, k = topk_ids.shape
    gu, dn, tile = experts.gate_up, experts.down, experts.tile
    if _mma_gemv_fits(experts, x):
        from fp4moe.kernels import nvfp4_mma_gemv as mma

        routing = align(topk_ids, experts.num_experts, mma.TOKENS)
        act = mma.mma_gate_up(x, *gu, routing, k, tile=tile)
        return mma.mma_down(act, *dn, routing, topk_weights, tile=tile)
    if t <= GEMV_MAX_TOKENS and x.shape[1] % 32 == 0 and experts.inter % 32 == 0:
        from fp4moe.kernels import nvfp4_gemv as gemv

        one_token_mma = (
            ONE_TOKEN_MMA_DOWN
            and topk_ids.dtype == torch.int32
            and topk_ids.is_contiguous()
            and topk_weights.dtype == torch.float32
            and _mma_gemv_fits(experts, x, one_token=True)
        )
        pairs = pair_routing(topk_ids, 1) if one_token_mma else None  # (a view of the ids: no copy)
        act = gemv.gemv_gate_up(x, *gu, topk_ids, tile=tile)
        if one_token_mma:
            from fp4moe.kernels import nvfp4_mma_gemv as mma

            tiles = None if tile else mma.ONE_TOKEN_DOWN_TILES  # (tiled: the tile's own, ``tiles_for``)
            return mma.mma_down(act, *dn, pairs, topk_weights, tiles=tiles, tile=tile)
        return gemv.gemv_down(act, *dn, topk_ids, topk_weights, tile=tile)
    # 128-row blocks only where the weights-first kernel takes both launches (K a multiple of its tile)
    bm = gemm.block_m(t, k, experts.num_experts, _weights_first(experts, x))
    if t <= PAIR_ROUTING_MAX_TOKENS and bm == 16:
        routing = pair_routing(topk_ids, bm)
    else:
        routing = align(topk_ids, experts.num_experts, bm)
    if _wgmma_fits(experts, x, bm):
        from fp4moe.kernels import nvfp4_wgmma as wg

        return wg.moe_pairs(x, gu, dn, routing, k, topk_weights.float(), tile=tile, x_k=x_k)
    act = gemm.moe_gate_up(x, *gu, routing, k, tile=tile)
    return gemm.moe_down(act, *dn, routing, topk_weights.float(), tile=tile)
