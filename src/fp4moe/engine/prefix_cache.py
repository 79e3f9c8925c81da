"""Prefix caching for a hybrid model: attention keys/values AND Gated DeltaNet states, at block boundaries.

Attention layers could reuse any cached prefix, but a Gated DeltaNet layer's state at position p exists only
if the forward stopped at p. So the prefill of each prompt is split to end at its last block boundary
p = floor((len - 1) / B) * B, and a snapshot is taken there: the keys/values of tokens [0, p) of every
attention layer and the conv + recurrent state of every DeltaNet layer at p, keyed by a hash of tokens
[0, p). A new prompt restores the longest snapshot whose tokens are a prefix of it (checked at every block
boundary, longest first) and prefills only the rest. Multi-turn chats hit: each turn's prompt extends the
last. Prompts with images are not cached (their tokens do not identify the image). Snapshots live in a
bounded LRU; each costs p x the KV bytes per token plus one DeltaNet state per layer.
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
    def __init__(self, block_size: int = 16, max_entries: int = 64):
        if block_size < 1 or max_entries < 1:
            raise ValueError("prefix cache block size and entries must be positive")
        self.block_size, self.max_entries = block_size, max_entries
        self._entries: OrderedDict[str, Snapshot] = OrderedDict()
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

    def store(self, prompt: list[int], p: int, kv_cache, states, slot: int) -> None:
        """Snapshot a slot that has consumed exactly ``p`` tokens of ``prompt`` (CPU or paged caches)."""
        self._entries[self._key(prompt, p)] = Snapshot(
            p, kv_cache.export_slot(slot, p), states.export_slot(slot)
        )
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    @staticmethod
    def restore(snap: Snapshot, kv_cache, states, slot: int) -> None:
        kv_cache.import_slot(slot, snap.kv)
        states.import_slot(slot, snap.states, snap.length)
