"""A whole greedy speculative round on the GPU runner as one static-shape step (one CUDA graph per batch
bucket): verify, accept, roll back, draft the next round -- the host reads back three small tensors.

A sequence enters a round with its pending token x_p at position p and k drafts d_1..d_k from the last
round (or from the module path's first drafting after prefill). The round:

1. runs the target over rows (sequence, t), t = 0..k: tokens x_p, d_1..d_k at positions p..p+k
   (``CudaModelRunner.forward_rows`` with T = k + 1: attention rows see the rows before them, the Gated
   DeltaNet kernel walks the k + 1 tokens in order and keeps the state after each one);
2. takes the target's greedy choices y_t and accepts a = the length of the prefix where d_{t+1} = y_t:
   the sequence gains d_1..d_a and the bonus token y_a;
3. rolls back: each Gated DeltaNet state becomes the one after token a (a copy from the history); the
   conv rings are long enough that nothing was lost, and keys/values past p+a are simply not counted;
4. catches the MTP head up on positions p..p+k with (target hidden h_{p+t}, token y_t) -- for t <= a, y_t
   is the token that really follows -- and drafts the next round's d'_1 from row a, then d'_2..d'_k from
   the head's own hidden states at positions p+a+1..p+a+k-1. Rows past a write MTP keys/values at
   positions the next round overwrites before anything reads them. Only row a goes on through the head's
   MoE (the other rows are needed for their keys/values alone).

Greedy only (temperature 0, no penalties, no logprobs): drafts and acceptance are argmax comparisons on
the GPU. Other sequences use the module path's round (``MTPSpeculator.step_many``), which is exact for
sampling too. Padded rows of a bucket point at the runner's scratch slot.
"""

from __future__ import annotations

import torch


class FusedSpecRound:
    def __init__(self, runner, k: int):
        if runner.spec_tokens != k:
            raise ValueError(f"the runner was built for {runner.spec_tokens} speculative tokens, not {k}")
        self.runner, self.k, self.t = runner, k, k + 1
        n, dev = runner.max_num_seqs, runner.device
        self.ids = torch.zeros(n, self.t, dtype=torch.long, device=dev)  # x_p, d_1..d_k
        self.pos = torch.zeros(n, dtype=torch.int32, device=dev)  # p
        self.slots = torch.full((n,), runner.scratch, dtype=torch.int32, device=dev)
        self.delta = torch.zeros(n, dtype=torch.int32, device=dev)  # rotary position - cache position
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # benchmarks only (timing, not output): every sequence accepts ``forced[0]`` drafts; set before the
        # first round, since graphs are captured with or without it
        self.forced: torch.Tensor | None = None

    def __call__(self, slots: list[int], positions: list[int], tokens: list[list[int]], deltas: list[int]):
        """One round for ``len(slots)`` sequences (pending position p, tokens [x_p, d_1..d_k], rotary
        offset) -> (accepted a [b], target choices y [b, k+1], next drafts [b, k]) as host tensors."""
        r, b = self.runner, len(slots)
        for slot, p in zip(slots, positions, strict=True):
            r.kv.reserve(slot, p + 2 * self.k)  # verification to p+k, MTP drafts to p+2k-1
        bucket = r.graph_bucket(b)
        if bucket is not None and bucket not in self.graphs:
            self._park()  # the warm-up round writes only the scratch slot
            self.graphs[bucket] = r.graph_of(lambda: self.forward(bucket))
        self._park()
        self.slots[:b] = torch.tensor(slots, dtype=torch.int32)
        self.pos[:b] = torch.tensor(positions, dtype=torch.int32)
        self.delta[:b] = torch.tensor(deltas, dtype=torch.int32)
        self.ids[:b] = torch.tensor(tokens, dtype=torch.long)
        if bucket is not None:
            graph, out = self.graphs[bucket]
            graph.replay()
        else:
            out = self.forward(b)
        out = out[:b].cpu()
        accepted, choices, drafts = out[:, 0], out[:, 1 : 1 + self.t], out[:, 1 + self.t :]
        for slot, p, a in zip(slots, positions, accepted.tolist(), strict=True):
            r.kv.advance(slot, p + a + 1)
        return accepted, choices, drafts

    def _park(self) -> None:
        """Every row at the scratch slot, position 0 (the padding of a bucket)."""
        self.slots.fill_(self.runner.scratch)
        self.pos.zero_()
        self.delta.zero_()
        self.ids.zero_()

    def forward(self, b: int) -> torch.Tensor:
        """The round over the first ``b`` buffer rows -> [b, 1 + (k+1) + k] int64: a, y, next drafts."""
        r, t, k = self.runner, self.t, self.k
        model = r.model
        steps = torch.arange(t, device=self.pos.device, dtype=torch.int32)
        pos = (self.pos[:b, None] + steps).reshape(-1)
        slots = self.slots[:b].repeat_interleave(t)
        rope = (pos + self.delta[:b].repeat_interleave(t)).long().expand(3, -1)
        _, x = r.forward_rows(self.ids[:b].reshape(-1), pos, slots, rope, tokens_per_seq=t)
        choices = model.lm_head(x).argmax(-1).view(b, t)
        agree = (self.ids[:b, 1:] == choices[:, :-1]).long().cumprod(1)
        accepted = agree.sum(1)  # [b]
        if self.forced is not None:
            accepted = self.forced.expand(b)
        rows = torch.arange(b, device=pos.device) * t + accepted
        st = r.states
        st.rec.index_copy_(1, self.slots[:b].long(), r.history[:, rows])
        hidden = r.mtp_rows(choices.reshape(-1), x, pos, slots, rope, keep=rows)  # after the bonus token
        drafts = [model.lm_head(hidden).argmax(-1)]
        for j in range(1, k):
            p = self.pos[:b] + accepted.int() + j
            hidden = r.mtp_rows(
                drafts[-1], hidden, p, self.slots[:b], (p + self.delta[:b]).long().expand(3, -1)
            )
            drafts.append(model.lm_head(hidden).argmax(-1))
        return torch.cat([accepted[:, None], choices, torch.stack(drafts, 1)], dim=1)
