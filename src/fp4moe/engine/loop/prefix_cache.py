"""Prefix caching for a hybrid model: attention keys/values AND Gated DeltaNet states, at block boundaries.

Attention layers could reuse any cached prefix, but a Gated DeltaNet layer's state at position p exists only
if the forward stopped at p. So the prefill of each prompt is split to end at its last block boundary
p = floor((len - 1) / B) * B, and a snapshot is taken there: the keys/values of tokens [0, p) of every
attention layer and the conv + recurrent state of every DeltaNet layer at p, keyed by a hash of tokens
[0, p). A new prompt restores the longest snapshot whose tokens are a prefix of it (checked at every block
boundary, longest first) and prefills only the rest. Multi-turn chats hit: each turn's prompt extends the
last. Prompts with images are not cached (their tokens do not identify the image). Snapshots live in host
memory, in an LRU bounded by entries and by bytes; each costs p x the KV bytes per token plus one DeltaNet
state per layer (a 512K-token prompt of the full-size model: 5.5 GiB with an fp8 cache), so a prompt whose
snapshot alone would pass the byte bound takes none (64 long-context snapshots bounded only by count
would have asked for ~350 GiB).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass
class Snapshot:
    length: int
    kv: object  # the KV cache's ``export_slot`` of tokens [0, p)
    states: object  # the DeltaNet states' ``export_slot`` at p
    nbytes: int = 0  # host bytes of both


def _nbytes(obj) -> int:
    """Bytes of the tensors in a snapshot's nested tuples, lists and dicts."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (tuple, list)):
        return sum(_nbytes(v) for v in obj)
    return 0


def block_keys(tokens: list[int], block_size: int) -> list[str]:
    """Chained hashes of the block-aligned prefixes: keys[k] identifies tokens[: (k + 1) * block_size].
    One pass over the prompt (not one hash per prefix length)."""
    keys, h = [], b""
    data = torch.tensor(tokens, dtype=torch.int64).numpy().tobytes()
    step = block_size * 8
    for k in range(len(tokens) // block_size):
        h = hashlib.sha256(h + data[k * step : (k + 1) * step]).digest()
        keys.append(h.hex())
    return keys


class PrefixCache:
    def __init__(self, block_size: int = 16, max_entries: int = 64, max_bytes: int | None = None):
        if block_size < 1 or max_entries < 1 or (max_bytes is not None and max_bytes < 1):
            raise ValueError("prefix cache block size, entries and bytes must be positive")
        self.block_size, self.max_entries, self.max_bytes = block_size, max_entries, max_bytes
        self._entries: OrderedDict[str, Snapshot] = OrderedDict()
        self.bytes = 0  # host bytes the snapshots hold
        self._cost: tuple[float, int] | None = None  # (KV bytes per token, state bytes), from the first one
        self.queries = 0  # prompt tokens looked up
        self.hits = 0  # prompt tokens served from the cache

    def boundary(self, prompt_len: int) -> int:
        """Where a prompt's snapshot is taken: its last block boundary that leaves a token to compute."""
        return (prompt_len - 1) // self.block_size * self.block_size

    def _key(self, prompt: list[int], p: int) -> str:
        return block_keys(prompt[:p], self.block_size)[-1]

    def lookup(self, prompt: list[int]) -> Snapshot | None:
        self.queries += len(prompt)
        keys = block_keys(prompt[: self.boundary(len(prompt))], self.block_size)
        for key in reversed(keys):  # longest first
            snap = self._entries.get(key)
            if snap is not None:
                self._entries.move_to_end(key)
                self.hits += snap.length
                return snap
        return None

    def contains(self, prompt: list[int], p: int) -> bool:
        return self._key(prompt, p) in self._entries

    def fits(self, p: int) -> bool:
        """Whether a snapshot of ``p`` tokens can be kept within the byte bound (before the first snapshot
        its cost is unknown: yes)."""
        if self.max_bytes is None or self._cost is None:
            return True
        per_token, state = self._cost
        return p * per_token + state <= self.max_bytes

    def store(self, prompt: list[int], p: int, kv_cache, states, slot: int) -> None:
        """Snapshot a slot that has consumed exactly ``p`` tokens of ``prompt`` (CPU or paged caches); the
        oldest snapshots go while more than ``max_entries`` or ``max_bytes`` are held. One that alone passes
        the byte bound is not kept."""
        if not self.fits(p):
            return
        snap = Snapshot(p, kv_cache.export_slot(slot, p), states.export_slot(slot))
        kv_bytes, state_bytes = _nbytes(snap.kv), _nbytes(snap.states)
        self._cost = (kv_bytes / p if p else 0.0, state_bytes)
        snap.nbytes = kv_bytes + state_bytes
        if self.max_bytes is not None and snap.nbytes > self.max_bytes:
            return
        key = self._key(prompt, p)
        replaced = self._entries.pop(key, None)
        self.bytes += snap.nbytes - (replaced.nbytes if replaced else 0)
        self._entries[key] = snap
        while len(self._entries) > self.max_entries or (
            self.max_bytes is not None and self.bytes > self.max_bytes
        ):
            _, oldest = self._entries.popitem(last=False)
            self.bytes -= oldest.nbytes

    @staticmethod
    def restore(snap: Snapshot, kv_cache, states, slot: int) -> None:
        kv_cache.import_slot(slot, snap.kv)
        states.import_slot(slot, snap.states, snap.length)
