"""The K order of the Hopper prefill expert GEMMs (``nvfp4_wgmma``): within each 128-wide chunk of K, physical
position k = 32 c + 8 j + 4 q + 2 t + h (code byte 16 c + 4 j + 2 q + t of a weight row, nibble h) sits at
logical position 32 j + 16 h + 8 q + 2 c + t, the order in which that kernel's dequantized weights reach the
MMA. Its activations are stored in the same order: ``permute_k`` in torch, or ``logical_column`` where a kernel
writes them (the post-attention norm, the gate/up launch for down). Spelled once here: ``SPLIT`` splits a
chunk (or a row's code bytes and their nibble), ``TO_LOGICAL`` reorders the parts."""

from __future__ import annotations

import torch
import triton
import triton.language as tl  # noqa: F401  (Triton's interpreter wants it in a jitted function's module)

STEP_K = 128  # K positions of a chunk: one 64-byte step of ``expert_layout``'s tile order
SPLIT = (4, 4, 2, 2, 2)  # (c, j, q, t, h)
TO_LOGICAL = (1, 4, 2, 0, 3)  # -> (j, h, q, c, t)


def permute_k(x: torch.Tensor) -> torch.Tensor:
    """x [T, K] -> the same rows with each 128-wide chunk in the K order (a new contiguous tensor)."""
    t, k = x.shape
    if k % STEP_K:
        raise ValueError(f"K = {k} is not a multiple of {STEP_K}")
    return x.reshape(t, k // STEP_K, *SPLIT).permute(0, 1, *(d + 2 for d in TO_LOGICAL)).reshape(t, k)


def k_order(k: int) -> torch.Tensor:
    """Physical K index of each logical position: ``permute_k(x) == x[:, k_order(k)]`` (int64 [k])."""
    return permute_k(torch.arange(k)[None])[0]


def unpermute_k(x: torch.Tensor) -> torch.Tensor:
    """``permute_k``'s inverse."""
    return x[:, torch.argsort(k_order(x.shape[1])).to(x.device)]


@triton.jit
def logical_column(p):
    """Where physical column ``p`` (any integer tensor) goes in the K order: the same chunk, position
    32 j + 16 h + 8 q + 2 c + t of p = 32 c + 8 j + 4 q + 2 t + h."""
    return (
        (p & -128)
        | ((p >> 3 & 3) << 5)
        | ((p & 1) << 4)
        | ((p >> 2 & 1) << 3)
        | ((p >> 5 & 3) << 1)
        | (p >> 1 & 1)
    )
