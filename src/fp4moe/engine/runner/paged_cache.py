"""The GPU engine's caches, preallocated once: paged attention keys/values and Gated DeltaNet state slots.

Both speak the interface of the CPU caches (``engine.reference.cache``), so the module forward (prefill, chunked
prefill, speculative verification) runs on them unchanged, and add the device tensors the fused decode
kernels read: per attention layer k/v pages [pages, page_size, Hkv, D] (bf16, or fp8-e4m3 with one scale per
layer and tensor, fixed before the first request: ``engine.loading.kv_scales``) and a block table
[slots, max_pages]; per Gated DeltaNet layer a conv-input ring [slots, R, C] indexed by position mod R (R = K,
the conv width, or K + k with k speculative tokens, so a verification's rejected inputs never overwrite
ones still needed) and an fp32 recurrent state [slots, Hv, Dk, Dv]. A slot's ring and state are valid up to its position; position
0 reads as zeros, so freed slots need no clearing.
"""

from __future__ import annotations

import torch

from fp4moe.engine.device.transfer import to_device
from fp4moe.engine.reference.cache import layer_scales
from fp4moe.formats import fp8
from fp4moe.layers.attention import attend, attend_each


class CacheFull(RuntimeError):
    pass


class PagedKVCache:
    def __init__(
        self,
        layer_ids: list[int],
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        max_slots: int,
        max_len: int,
        dtype: str,
        act_dtype: torch.dtype,
        device: torch.device,
    ):
        if dtype not in ("auto", "fp8"):
            raise ValueError(f"kv cache dtype must be 'auto' or 'fp8', got {dtype!r}")
        self.fp8 = dtype == "fp8"
        store = torch.float8_e4m3fn if self.fp8 else act_dtype
        self.page_size, self.max_len, self.device = page_size, max_len, device
        self.index = {layer: i for i, layer in enumerate(layer_ids)}
        shape = (len(layer_ids), num_pages, page_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=store, device=device)
        self.v = torch.zeros(shape, dtype=store, device=device)
        self.scale_t = torch.ones(len(layer_ids), 2, dtype=torch.float32, device=device)
        self.scales: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.max_pages = -(-max_len // page_size)
        self.block_table = torch.zeros(max_slots, self.max_pages, dtype=torch.int32, device=device)
        self._free = list(range(num_pages - 1, -1, -1))
        self._pages: dict[int, list[int]] = {}
        self._len: dict[tuple[int, int], int] = {}

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    def reserve(self, slot: int, length: int) -> None:
        """Make sure the slot has pages for ``length`` tokens."""
        if length > self.max_len:
            raise CacheFull(f"sequence of {length} tokens exceeds max_model_len {self.max_len}")
        pages = self._pages.setdefault(slot, [])
        need = -(-length // self.page_size) - len(pages)
        if need > len(self._free):
            raise CacheFull(f"KV cache full: need {need} pages, {len(self._free)} free")
        if need > 0:
            new = [self._free.pop() for _ in range(need)]
            # through pinned memory: a pageable copy would wait for the GPU (the step in flight, with async
            # scheduling; the H200's served profile at 64 streams had 9% of the engine thread on this line)
            self.block_table[slot, len(pages) : len(pages) + need] = to_device(new, torch.int32, self.device)
            pages.extend(new)

    def rows(self, slot: int, start: int, end: int) -> torch.Tensor:
        """Flat row index (page * page_size + offset) of the slot's positions [start, end)."""
        pos = torch.arange(start, end, device=self.device)
        return self.block_table[slot, pos // self.page_size].long() * self.page_size + pos % self.page_size

    def set_scales(self, scales: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """An fp8 cache's scales {layer: (k, v)}, fixed before the first token is written (``engine.loading.kv_scales``);
        written in place into ``scale_t``, the tensor the kernels and CUDA graphs read."""
        missing = sorted(set(self.index) - set(scales))
        if self.fp8 and missing:
            raise ValueError(f"fp8 KV cache: no scales for layers {missing}")
        for layer, i in self.index.items():
            if layer in scales:
                ks, vs = (x.float().reshape(()).to(self.device) for x in scales[layer])
                self.scales[layer] = (ks, vs)
                self.scale_t[i] = torch.stack([ks, vs])

    def append(
        self, layer: int, slot: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The CPU cache's contract: add k/v [n, Hkv, D]; return all of the slot's k/v [L, Hkv, D]."""
        start = self.length(layer, slot)
        end = start + k.shape[0]
        self.reserve(slot, end)
        i = self.index[layer]
        kc, vc = self.k[i].view(-1, *k.shape[1:]), self.v[i].view(-1, *k.shape[1:])
        if self.fp8:
            ks, vs = layer_scales(self.scales, layer)
            kc[self.rows(slot, start, end)], vc[self.rows(slot, start, end)] = (
                fp8.encode(k, ks),
                fp8.encode(v, vs),
            )
        else:
            kc[self.rows(slot, start, end)], vc[self.rows(slot, start, end)] = k, v
        self._len[(layer, slot)] = end
        rows = self.rows(slot, 0, end)
        if self.fp8:
            ks, vs = self.scales[layer]
            return fp8.decode(kc[rows], ks, k.dtype), fp8.decode(vc[rows], vs, k.dtype)
        return kc[rows], vc[rows]

    def append_step(
        self, layer: int, ctx, k: torch.Tensor, v: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``append`` for every sequence of a step at once: one scatter of all rows into their pages (row
        addresses from the step's device layout, ``StepContext.tensors``), then each sequence's whole k/v:
        a fresh prompt's are its own rows (as stored: through fp8 and back for an fp8 cache), so only a
        continuing chunk reads its pages. A prefill layer made ~20 small launches per sequence before."""
        spans = ctx.spans()
        if not self._aligned(layer, ctx):
            return [self.append(layer, s, k[a:b], v[a:b]) for s, (a, b) in zip(ctx.slots, spans, strict=True)]
        k, v = self._store_step(layer, ctx, k, v)
        i = self.index[layer]
        kc, vc = self.k[i].view(-1, *k.shape[1:]), self.v[i].view(-1, *k.shape[1:])
        out = []
        for slot, cached, (a, b) in zip(ctx.slots, ctx.cached_lens, spans, strict=True):
            if cached == 0:
                out.append((k[a:b], v[a:b]))
                continue
            whole = self.rows(slot, 0, cached + b - a)
            if self.fp8:
                ks, vs = self.scales[layer]
                out.append((fp8.decode(kc[whole], ks, k.dtype), fp8.decode(vc[whole], vs, v.dtype)))
            else:
                out.append((kc[whole], vc[whole]))
        return out

    def _aligned(self, layer: int, ctx) -> bool:
        """Whether every sequence of the step holds in this layer what the step says it has cached (where
        not, ``append_step`` appends each at its own length)."""
        return all(self.length(layer, s) == c for s, c in zip(ctx.slots, ctx.cached_lens, strict=True))

    def _store_step(self, layer: int, ctx, k: torch.Tensor, v: torch.Tensor):
        """Every row of the step written into its page at its position, in one scatter -> the k/v as stored."""
        for slot, cached, n in zip(ctx.slots, ctx.cached_lens, ctx.query_lens, strict=True):
            self.reserve(slot, cached + n)
            self._len[(layer, slot)] = cached + n
        t, page = ctx.tensors(self.device), self.page_size
        seq = t.token_seq.long()
        pos = t.cached[seq] + torch.arange(k.shape[0], device=self.device) - t.starts[seq]
        rows = self.block_table[t.slots[seq], pos // page].long() * page + pos % page
        if self.fp8:
            layer_scales(self.scales, layer)  # set at start: store reads them from scale_t
        return self.store(layer, rows, k, v)

    def attend_step(self, layer: int, ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``KVCache.attend_step`` on the pages: fresh prompts attend over their own rows (flash attention,
        as ``append_step`` hands them out); sequences with cached tokens through the paged kernel, one launch
        for all of them (``paged_prefill_attention``: no gather of the prefix, no mask; gathering each chunk's
        whole prefix and masking it grew with the context and stopped at 32K)."""
        if not any(ctx.cached_lens) or not self._aligned(layer, ctx):
            return attend_each(q, self.append_step(layer, ctx, k, v), ctx)
        from fp4moe.kernels.attention import paged_prefill_attention, prefill_block_tokens

        k, v = self._store_step(layer, ctx, k, v)
        i, (_, heads, dim), hkv = self.index[layer], q.shape, k.shape[1]
        blocks = ctx.chunk_indices(self.device, prefill_block_tokens(heads // hkv, self.fp8), continuing=True)
        out = paged_prefill_attention(
            q.contiguous(), self.k[i], self.v[i], self.block_table, ctx.tensors(self.device), blocks,
            self.scale_t[i], (heads, hkv, dim),
        )  # fmt: skip
        for cached, (a, b) in zip(ctx.cached_lens, ctx.spans(), strict=True):
            if cached == 0:  # a fresh prompt beside them: its own rows, as stored
                out[a:b] = attend(q[a:b], k[a:b], v[a:b], 0)
        return out

    def store(
        self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k/v [n, Hkv, D] at flat page rows (page * page_size + offset) of a layer -> the k/v as
        stored (through fp8 and back for an fp8 cache, with the layer's scales read from ``scale_t``, which
        ``set_scales`` fills in place: the tensor CUDA graphs read). Device work only."""
        i = self.index[layer]
        kc, vc = self.k[i].view(-1, *k.shape[1:]), self.v[i].view(-1, *k.shape[1:])
        if not self.fp8:
            kc[rows], vc[rows] = k, v
            return k, v
        ks, vs = self.scale_t[i, 0], self.scale_t[i, 1]
        kq, vq = fp8.encode(k, ks), fp8.encode(v, vs)
        kc[rows], vc[rows] = kq, vq
        return fp8.decode(kq, ks, k.dtype), fp8.decode(vq, vs, v.dtype)

    def advance(self, slot: int, length: int, layers=None) -> None:
        """After a fused step wrote position length-1 of every layer (or of ``layers``)."""
        for layer in self.index if layers is None else layers:
            self._len[(layer, slot)] = length

    def truncate(self, layer: int, slot: int, length: int) -> None:
        if (layer, slot) in self._len:
            self._len[(layer, slot)] = min(self._len[(layer, slot)], length)

    def length(self, layer: int, slot: int) -> int:
        return self._len.get((layer, slot), 0)

    def export_slot(self, slot: int, length: int):
        """Host copies of the slot's first ``length`` stored keys/values, every layer ([layers, length, Hkv,
        D]), and how many of them each layer really holds (the MTP layer may hold fewer)."""
        rows = self.rows(slot, 0, length)
        flat = (self.k.shape[0], -1, *self.k.shape[3:])
        lengths = {layer: min(self.length(layer, slot), length) for layer in self.index}
        k, v = (t.view(flat)[:, rows].to("cpu", copy=True) for t in (self.k, self.v))
        return k, v, lengths

    def import_slot(self, slot: int, data) -> None:
        k, v, lengths = data
        length = k.shape[1]
        self.reserve(slot, length)
        rows = self.rows(slot, 0, length)
        flat = (self.k.shape[0], -1, *self.k.shape[3:])
        self.k.view(flat)[:, rows] = k.to(self.device)
        self.v.view(flat)[:, rows] = v.to(self.device)
        for layer, n in lengths.items():
            self._len[(layer, slot)] = n

    def free(self, slot: int) -> None:
        self._free.extend(reversed(self._pages.pop(slot, [])))
        for key in [key for key in self._len if key[1] == slot]:
            del self._len[key]


class SlotStates:
    """Gated DeltaNet states in slots. ``get``/``set`` take the number of tokens the slot has consumed
    before / after the step (the conv ring is indexed by position)."""

    def __init__(
        self,
        layer_ids: list[int],
        max_slots: int,
        conv_dim: int,
        conv_kernel: int,
        num_v_heads: int,
        k_dim: int,
        v_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        ring_len: int | None = None,
    ):
        self.index = {layer: i for i, layer in enumerate(layer_ids)}
        self.kc, self.dtype, self.device = conv_kernel, dtype, device
        self.ring_len = ring_len or conv_kernel
        if self.ring_len < conv_kernel:
            raise ValueError(f"a conv ring of {self.ring_len} cannot hold a conv of width {conv_kernel}")
        self.ring = torch.zeros(
            len(layer_ids), max_slots, self.ring_len, conv_dim, dtype=dtype, device=device
        )
        self.rec = torch.zeros(len(layer_ids), max_slots, num_v_heads, k_dim, v_dim, device=device)

    def _ring_index(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Ring entries holding positions end-K+1 .. end-1 (oldest first) and which of them exist, as device
        tensors made on the device: indexing a CUDA tensor with a host list copies the list from pageable
        memory, which waits for the GPU -- a few times per layer of a prefill."""
        pos = torch.arange(end - self.kc + 1, end, device=self.device)
        return pos.remainder(self.ring_len), pos >= 0

    def get(self, layer: int, slot: int, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        i, pos = self.index[layer], position
        rows, valid = self._ring_index(pos)
        conv = torch.where(valid, self.ring[i, slot].index_select(0, rows).T, 0)  # [C, K-1]
        rec = self.rec[i, slot] if pos > 0 else torch.zeros_like(self.rec[i, slot])
        return conv, rec

    def set(self, layer: int, slot: int, conv: torch.Tensor, rec: torch.Tensor, position: int) -> None:
        i, end = self.index[layer], position
        rows, _ = self._ring_index(end)
        self.ring[i, slot].index_copy_(0, rows, conv.T.to(self.dtype))
        self.rec[i, slot] = rec

    def gather(self, layer: int, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        """Every sequence's states of a step (``StepContext``) at once: conv [N, C, K-1], recurrent [N, Hv,
        Dk, Dv] -- device indexing only, no per-sequence work on the host."""
        t, i = ctx.tensors(self.device), self.index[layer]
        pos = t.cached[:, None] - self.kc + 1 + torch.arange(self.kc - 1, device=self.device)  # [N, K-1]
        ring = self.ring[i][t.slots[:, None], pos.remainder(self.ring_len)]  # [N, K-1, C]
        conv = torch.where((pos >= 0)[:, :, None], ring, 0).transpose(1, 2)
        rec = torch.where((t.cached > 0)[:, None, None, None], self.rec[i][t.slots], 0)
        return conv, rec

    def scatter(self, layer: int, ctx, conv: torch.Tensor, rec: torch.Tensor) -> None:
        """Store what ``gather`` read, after the step's tokens (conv [N, C, K-1] the last inputs)."""
        t, i = ctx.tensors(self.device), self.index[layer]
        end = t.cached + (t.ends - t.starts)
        pos = end[:, None] - self.kc + 1 + torch.arange(self.kc - 1, device=self.device)
        self.ring[i][t.slots[:, None], pos.remainder(self.ring_len)] = conv.transpose(1, 2).to(self.dtype)
        self.rec[i][t.slots] = rec

    def free(self, slot: int) -> None:
        """Nothing to release: position 0 reads as a zero state, so a reused slot needs no clearing."""

    def snapshot(self, slot: int):
        return self.ring[:, slot].clone(), self.rec[:, slot].clone()

    def restore(self, slot: int, snapshot) -> None:
        self.ring[:, slot], self.rec[:, slot] = snapshot

    def export_slot(self, slot: int):
        """A host copy of the slot's states (prefix-cache snapshots live in host memory)."""
        return self.ring[:, slot].to("cpu", copy=True), self.rec[:, slot].to("cpu", copy=True)

    def import_slot(self, slot: int, data, position: int) -> None:
        self.ring[:, slot], self.rec[:, slot] = (t.to(self.device) for t in data)
