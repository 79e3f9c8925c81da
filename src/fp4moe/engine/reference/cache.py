"""Per-sequence caches of the CPU reference engine: attention keys/values and Gated DeltaNet states.

Keys/values of a slot grow by concatenation (simple and exact; the paged fp8 cache of the GPU engine is
a separate piece of work). Gated DeltaNet keeps, per layer and slot, the conv state [C, K-1] (the last
inputs) and the fp32 recurrent state [Hv, Dk, Dv]; absent means zeros (a fresh sequence)."""

from __future__ import annotations

import torch

from fp4moe.formats import fp8
from fp4moe.layers.attention import attend_each


def layer_scales(scales: dict, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp8 cache's (k, v) scales of ``layer``, which must have been set before its first write."""
    if layer not in scales:
        raise RuntimeError(
            f"fp8 KV cache: no scales for layer {layer} (engine.loading.kv_scales sets them at start)"
        )
    return scales[layer]


class KVCache:
    """``dtype="fp8"`` stores keys and values as float8-e4m3 with one scale per layer and tensor (k, v):
    ``scales`` {layer: (k scale, v scale)}, fixed before the first token is written (``engine.loading.kv_scales``:
    the checkpoint's, else calibrated at start-up), so no request's answer depends on the ones before it."""

    def __init__(
        self, dtype: str = "auto", scales: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
    ):
        if dtype not in ("auto", "fp8"):
            raise ValueError(f"kv cache dtype must be 'auto' or 'fp8', got {dtype!r}")
        self.fp8 = dtype == "fp8"
        self.scales: dict[int, tuple[torch.Tensor, torch.Tensor]] = dict(scales or {})
        self._kv: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def _encode(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ks, vs = layer_scales(self.scales, layer)
        return fp8.encode(k, ks), fp8.encode(v, vs)

    def append(
        self, layer: int, slot: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Add k/v [n, Hkv, D] to the slot's cache; returns all cached k/v [L, Hkv, D] in k's dtype."""
        dtype = k.dtype
        if self.fp8:
            k, v = self._encode(layer, k, v)
        old = self._kv.get((layer, slot))
        if old is not None:
            k, v = torch.cat([old[0], k]), torch.cat([old[1], v])
        self._kv[(layer, slot)] = (k, v)
        if self.fp8:
            ks, vs = self.scales[layer]
            return fp8.decode(k, ks, dtype), fp8.decode(v, vs, dtype)
        return k, v

    def append_step(
        self, layer: int, ctx, k: torch.Tensor, v: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A step's keys/values [T, Hkv, D] (``StepContext``: sequence i's rows at its span) added to each
        sequence's cache; returns each sequence's whole k/v, as ``append`` does."""
        return [
            self.append(layer, slot, k[a:b], v[a:b])
            for slot, (a, b) in zip(ctx.slots, ctx.spans(), strict=True)
        ]

    def attend_step(self, layer: int, ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The step's keys/values added (``append_step``), then its rows q [T, H, D] attending causally over
        their sequences' caches -> [T, H, D]."""
        return attend_each(q, self.append_step(layer, ctx, k, v), ctx)

    def truncate(self, layer: int, slot: int, length: int) -> None:
        """Keep the first ``length`` tokens of a slot's cache at one layer (speculative-decoding rollback)."""
        entry = self._kv.get((layer, slot))
        if entry is not None:
            self._kv[(layer, slot)] = (entry[0][:length], entry[1][:length])

    def length(self, layer: int, slot: int) -> int:
        kv = self._kv.get((layer, slot))
        return 0 if kv is None else kv[0].shape[0]

    def free(self, slot: int) -> None:
        for key in [k for k in self._kv if k[1] == slot]:
            del self._kv[key]

    def export_slot(self, slot: int, length: int) -> dict:
        """Copies of the slot's first ``length`` stored keys/values per layer (prefix caching)."""
        return {
            key[0]: (k[:length].clone(), v[:length].clone())
            for key, (k, v) in self._kv.items()
            if key[1] == slot
        }

    def import_slot(self, slot: int, data: dict) -> None:
        for layer, (k, v) in data.items():
            self._kv[(layer, slot)] = (k.clone(), v.clone())


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

    def get(self, layer: int, slot: int, position: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The slot's (conv, recurrent) state; ``position`` (tokens consumed) is for caches that need it."""
        state = self._states.get((layer, slot))
        if state is None:
            return (
                torch.zeros(self.conv_shape, dtype=self.dtype, device=self.device),
                torch.zeros(self.rec_shape, dtype=torch.float32, device=self.device),
            )
        return state

    def set(
        self, layer: int, slot: int, conv: torch.Tensor, rec: torch.Tensor, position: int | None = None
    ) -> None:
        self._states[(layer, slot)] = (conv, rec)

    def gather(self, layer: int, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        """Every sequence's states of a step (``StepContext``), stacked: conv [N, C, K-1], recurrent [N, ...]."""
        states = [self.get(layer, slot) for slot in ctx.slots]
        return torch.stack([c.to(self.dtype) for c, _ in states]), torch.stack([r for _, r in states])

    def scatter(self, layer: int, ctx, conv: torch.Tensor, rec: torch.Tensor) -> None:
        for j, slot in enumerate(ctx.slots):
            self.set(layer, slot, conv[j], rec[j])

    def free(self, slot: int) -> None:
        for key in [k for k in self._states if k[1] == slot]:
            del self._states[key]

    def snapshot(self, slot: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's state of one slot (tensors are replaced, never written in place, so no copy)."""
        return {key[0]: value for key, value in self._states.items() if key[1] == slot}

    def restore(self, slot: int, snapshot: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.free(slot)
        for layer, value in snapshot.items():
            self._states[(layer, slot)] = value

    def export_slot(self, slot: int) -> dict:
        return {layer: (conv.clone(), rec.clone()) for layer, (conv, rec) in self.snapshot(slot).items()}

    def import_slot(self, slot: int, data: dict, position: int) -> None:
        self.restore(slot, {layer: (conv.clone(), rec.clone()) for layer, (conv, rec) in data.items()})
