"""Per-step context of a flat batch: where each sequence's tokens are, how many it has cached, its slot."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import torch

from fp4moe.engine.device.transfer import upload
from fp4moe.engine.reference.cache import DeltaNetStates, KVCache


@dataclass
class StepTensors:
    """A step's batch layout as device tensors, made once per step for every layer (a GPU prefill's layers
    read it instead of indexing per sequence: fla's chunked rule was 0.85 ms of host time per call and
    sequence, 2.8 s for 64 prompts of 128 tokens on the H200, benchmarks/prefill_batch.py)."""

    slots: torch.Tensor  # [N] long
    cached: torch.Tensor  # [N] long: tokens each sequence had cached before the step
    starts: torch.Tensor  # [N] int32: first row of each sequence in the flat batch
    ends: torch.Tensor  # [N] long: one past its last row
    token_seq: torch.Tensor  # [T] int32: the sequence of each row
    cu_seqlens: torch.Tensor  # [N + 1] long: flash-attention's varlen offsets
    cu_seqlens_cpu: torch.Tensor  # the same on the host (fla plans its chunks from it without a sync)


@dataclass
class StepContext:
    query_lens: list[int]  # tokens of each sequence in this step
    cached_lens: list[int]  # tokens of each sequence already in the caches
    slots: list[int]  # cache / state slot of each sequence
    kv: KVCache
    deltanet: DeltaNetStates
    _tensors: dict = field(default_factory=dict, repr=False)

    def spans(self) -> list[tuple[int, int]]:
        """[start, end) of each sequence in the flat batch."""
        ends = list(accumulate(self.query_lens))
        return [(e - n, e) for e, n in zip(ends, self.query_lens, strict=True)]

    def tensors(self, device: torch.device) -> StepTensors:
        """The batch layout on ``device``: one host-to-device copy per step (from pinned memory, so it does
        not wait for the GPU), shared by every layer."""
        device = torch.device(device)
        if device not in self._tensors:
            n, lens = len(self.query_lens), torch.tensor(self.query_lens, dtype=torch.long)
            cu = torch.zeros(n + 1, dtype=torch.long)
            torch.cumsum(lens, 0, out=cu[1:])
            host = torch.cat([
                torch.tensor(self.slots, dtype=torch.long), torch.tensor(self.cached_lens, dtype=torch.long), cu,
                torch.repeat_interleave(torch.arange(n), lens),
            ])  # fmt: skip
            dev = upload(host, device)
            slots, cached, cu_dev, token_seq = dev.split([n, n, n + 1, int(cu[-1])])
            self._tensors[device] = StepTensors(
                slots, cached, cu_dev[:-1].int(), cu_dev[1:], token_seq.int(), cu_dev, cu
            )
        return self._tensors[device]

    def chunk_indices(self, device: torch.device, chunk: int, continuing: bool = False) -> torch.Tensor:
        """(sequence, chunk within it) of every ``chunk``-token chunk of the step's sequences [chunks, 2]
        on ``device`` (``continuing``: of those with cached tokens only), made once per step from pinned
        memory (fla's chunked rule plans the same from cu_seqlens in each call, with a copy that waits for
        the GPU: a sync per layer)."""
        key = (torch.device(device), chunk, continuing)
        if key not in self._tensors:
            pairs = [(i, j) for i, (n, c) in enumerate(zip(self.query_lens, self.cached_lens, strict=True))
                     if c or not continuing for j in range(-(-n // chunk))]  # fmt: skip
            self._tensors[key] = upload(torch.tensor(pairs, dtype=torch.long).view(-1, 2), key[0])
        return self._tensors[key]
