"""Per-sequence caches of the CPU reference engine: attention keys/values and Gated DeltaNet states.

Keys/values of a slot grow by concatenation (simple and exact; the paged fp8 cache of the GPU engine is
a separate piece of work). Gated DeltaNet keeps, per layer and slot, the conv state [C, K-1] (the last
inputs) and the fp32 recurrent state [Hv, Dk, Dv]; absent means zeros (a fresh sequence)."""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self):
        self._kv: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def append(
        self, layer: int, slot: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Add k/v [n, Hkv, D] to the slot's cache; returns all cached k/v [L, Hkv, D]."""
        old = self._kv.get((layer, slot))
        if old is not None:
            k, v = torch.cat([old[0], k]), torch.cat([old[1], v])
        self._kv[(layer, slot)] = (k, v)
        return k, v

    def length(self, layer: int, slot: int) -> int:
        kv = self._kv.get((layer, slot))
        return 0 if kv is None else kv[0].shape[0]

    def free(self, slot: int) -> None:
        for key in [k for k in self._kv if k[1] == slot]:
            del self._kv[key]


class DeltaNetStates:
    def __init__(
        self,
        conv_dim: int,
        conv_kernel: int,
        num_v_heads: int,
        k_dim: int,
        v_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.conv_shape = (conv_dim, conv_kernel - 1)
        self.rec_shape = (num_v_heads, k_dim, v_dim)
        self.dtype, self.device = dtype, device
        self._states: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, layer: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        state = self._states.get((layer, slot))
        if state is None:
            return (
                torch.zeros(self.conv_shape, dtype=self.dtype, device=self.device),
                torch.zeros(self.rec_shape, dtype=torch.float32, device=self.device),
            )
        return state

    def set(self, layer: int, slot: int, conv: torch.Tensor, rec: torch.Tensor) -> None:
        self._states[(layer, slot)] = (conv, rec)

    def free(self, slot: int) -> None:
        for key in [k for k in self._states if k[1] == slot]:
            del self._states[key]
