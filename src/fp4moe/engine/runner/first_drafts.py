"""The MTP head's first drafts of greedy sequences fresh from their prompt (or from plain steps), through CUDA
graphs where one takes them.

Before a greedy sequence's first speculative round the head catches up on every position it has not seen (the
whole prompt: its keys and values stored for every row, only the last row on through the MoE), then drafts k
tokens (``MTPSpeculator._first_drafts``). Run eagerly (``eager``) that is two passes of the MTP layer and k
lm_head GEMVs: ~80 kernel launches and ~100 small torch ops, 7.7 ms of host time against 0.83 ms of kernels
on the H200 at pp 512 (``benchmarks/first_round.py``), every request's. Here the same computation is captured per (sequences,
rows each) bucket -- the prefill graphs' buckets (``CudaModelRunner.prompt_bucket``), so a fresh prompt's
catch-up pads exactly as its prefill did -- and a request's first drafts are one upload, one device copy of
each sequence's hidden states, a replay and the caller's read-back.

Padding: a sequence's rows past its catch-up, and whole padded sequences, write the scratch slot (position 0;
its drafts' rows positions 0..k-2), which no live sequence reads; a padded sequence keeps a padded row.
"""

from __future__ import annotations

import itertools

import torch

from fp4moe.engine.device.transfer import to_device, upload
from fp4moe.engine.request.sequence import Sequence


class FirstDrafts:
    def __init__(self, runner, k: int, max_rows: int, max_seqs: int):
        self.runner, self.k = runner, k
        self.use_graphs = True  # off: always eager (benchmarks/first_round.py compares the two)
        dev, scratch = runner.device, runner.scratch
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self.ids = torch.zeros(max_rows, dtype=torch.long, device=dev)
        self.pos = torch.zeros(max_rows, dtype=torch.int32, device=dev)
        self.slot = torch.full((max_rows,), scratch, dtype=torch.int32, device=dev)
        self.hidden = torch.zeros(
            max_rows, runner.args.hidden_size, dtype=runner.model.embed_tokens.dtype, device=dev
        )
        self.keep = torch.zeros(max_seqs, dtype=torch.long, device=dev)  # each sequence's last catch-up row
        self.at = torch.zeros(max_seqs, dtype=torch.int32, device=dev)  # its first draft's position
        self.own = torch.full((max_seqs,), scratch, dtype=torch.int32, device=dev)

    def __call__(self, seqs: list[Sequence], ps: list[int]) -> torch.Tensor:
        """The head's k greedy drafts [len(seqs), k] on the device for ``seqs``, each catching up on positions
        ``mtp_cached`` .. p - 1 (its ``hidden_tail``) with the tokens after them, then drafting positions
        p + 1 .. p + k: through the graph of their bucket, else eagerly. Pages for every row are the caller's
        to reserve; the caller advances the head's cache."""
        bucket = self.bucket(seqs, ps)
        return self.eager(seqs, ps) if bucket is None else self.replay(seqs, ps, bucket)

    def bucket(self, seqs: list[Sequence], ps: list[int]) -> tuple[int, int] | None:
        """The graph (sequences, rows each) for these catch-ups, or None: graphs off, a catch-up longer than
        the prefill graphs take, or rotary positions that are not the cache positions (images)."""
        if not self.use_graphs or any(s.prompt_positions is not None for s in seqs):
            return None
        return self.runner.prompt_bucket([p - s.mtp_cached for s, p in zip(seqs, ps, strict=True)])

    def eager(self, seqs: list[Sequence], ps: list[int]) -> torch.Tensor:
        """The same computation without a graph: the MTP rows and lm_head launched one by one."""
        r, dev = self.runner, self.runner.device
        spans = list(zip(seqs, ps, strict=True))
        lens = [p - s.mtp_cached for s, p in spans]
        ids = [t for s, p in spans for t in s.tokens(s.mtp_cached + 1, p + 1)]
        pos = [q for s, p in spans for q in range(s.mtp_cached, p)]
        slots = [s.slot for s, n in zip(seqs, lens, strict=True) for _ in range(n)]
        rope = torch.cat([s.positions(s.mtp_cached, p) for s, p in spans], dim=1)
        last = list(itertools.accumulate(lens))
        hidden = r.mtp_rows(
            to_device(ids, torch.long, dev), torch.cat([s.hidden_tail for s in seqs]),
            to_device(pos, torch.int32, dev), to_device(slots, torch.int32, dev), upload(rope, dev),
            keep=to_device([n - 1 for n in last], torch.long, dev),
        )  # fmt: skip
        own = to_device([s.slot for s in seqs], torch.int32, dev)
        drafts = []
        for j in range(self.k):
            drafts.append(r.model.mtp.greedy(r.model, hidden))
            if j + 1 < self.k:  # the next draft from the head's own output at p + j
                at = to_device([p + j for p in ps], torch.int32, dev)
                rope = torch.cat([s.positions(p + j, p + j + 1) for s, p in spans], dim=1)
                hidden = r.mtp_rows(drafts[-1], hidden, at, own, upload(rope, dev))
        return torch.stack(drafts, 1)

    def replay(self, seqs: list[Sequence], ps: list[int], bucket: tuple[int, int]) -> torch.Tensor:
        """Through the graph of ``bucket`` (captured on first use): a view of its output buffer."""
        b, t = bucket
        if bucket not in self.graphs:
            self._capture(b, t)
        n = b * t
        host = torch.zeros(3 * n + 3 * b, dtype=torch.long)
        ids, pos, slot = host[:n], host[n : 2 * n], host[2 * n : 3 * n]
        keep, at, own = host[3 * n : 3 * n + b], host[3 * n + b : 3 * n + 2 * b], host[3 * n + 2 * b :]
        slot.fill_(self.runner.scratch)
        own.fill_(self.runner.scratch)
        keep.copy_(torch.arange(b) * t)
        for i, (s, p) in enumerate(zip(seqs, ps, strict=True)):
            r, m = i * t, p - s.mtp_cached
            ids[r : r + m] = torch.tensor(s.tokens(s.mtp_cached + 1, p + 1))
            pos[r : r + m] = torch.arange(s.mtp_cached, p)
            slot[r : r + m] = s.slot
            keep[i], at[i], own[i] = r + m - 1, p, s.slot
            self.hidden[r : r + m].copy_(s.hidden_tail)
        dev = upload(host, self.runner.device)
        self.ids[:n].copy_(dev[:n])
        self.pos[:n].copy_(dev[n : 2 * n])
        self.slot[:n].copy_(dev[2 * n : 3 * n])
        self.keep[:b].copy_(dev[3 * n : 3 * n + b])
        self.at[:b].copy_(dev[3 * n + b : 3 * n + 2 * b])
        self.own[:b].copy_(dev[3 * n + 2 * b :])
        graph, drafts = self.graphs[bucket]
        graph.replay()
        return drafts[: len(seqs)]

    def forward(self, b: int, t: int) -> torch.Tensor:
        """The captured computation over the buffers' first ``b`` x ``t`` rows -> drafts [b, k]."""
        r, n = self.runner, b * t
        hidden = r.mtp_rows(
            self.ids[:n], self.hidden[:n], self.pos[:n], self.slot[:n], self.pos[:n], self.keep[:b]
        )
        drafts = []
        for j in range(self.k):
            drafts.append(r.model.mtp.greedy(r.model, hidden))
            if j + 1 < self.k:  # the next draft from the head's own output at p + j
                at = self.at[:b] + j
                hidden = r.mtp_rows(drafts[-1], hidden, at, self.own[:b], at)
        return torch.stack(drafts, 1)

    def _capture(self, b: int, t: int) -> None:
        """Warm up and capture bucket (b, t) with every row on the scratch slot."""
        self.ids.zero_()
        self.pos.zero_()
        self.slot.fill_(self.runner.scratch)
        self.keep.zero_()
        self.at.zero_()
        self.own.fill_(self.runner.scratch)
        if self._pool is None and self.runner.device.type == "cuda":
            self._pool = torch.cuda.graph_pool_handle()
        self.graphs[(b, t)] = self.runner.graph_of(lambda: self.forward(b, t), pool=self._pool)

    def pending(self, buckets) -> list[tuple[int, int]]:
        """The buckets of ``buckets`` not captured yet."""
        return [(b, t) for b, t in buckets if (b, t) not in self.graphs]

    def capture(self, buckets, tick=None) -> None:
        """Capture every bucket not captured yet (``tick``: called after each)."""
        for b, t in self.pending(buckets):
            self._capture(b, t)
            if tick is not None:
                tick()
