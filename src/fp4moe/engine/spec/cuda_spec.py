"""A whole speculative round on the GPU runner as one static-shape step (one CUDA graph per batch bucket and
sampling variant): verify, accept, roll back, draft the next round -- the host reads back one small tensor.

A sequence enters a round with its pending token x_p at position p and k drafts d_1..d_k from the last
round (or from the module path's first drafting after prefill). The round:

1. runs the target over rows (sequence, t), t = 0..k: tokens x_p, d_1..d_k at positions p..p+k
   (``CudaModelRunner.forward_rows`` with T = k + 1: attention rows see the rows before them, the Gated
   DeltaNet kernel walks the k + 1 tokens in order and keeps the state after each one);
2. accepts a drafts and picks the token y_a that follows them. Greedy rows: a = the length of the prefix
   where d_{t+1} equals the target's argmax y_t, and y_a is the argmax at row a. Sampled rows: speculative
   rejection sampling (``engine.spec.spec_sampling.accept_drafts``) with the target's filtered distributions
   p_t and the draft distributions q_t the drafts were drawn from -- draft j is accepted when
   u_j q_j(d_j) <= p_j(d_j), the final token comes from max(0, p_a - q_a) (or p_k after k acceptances);
   the sequence gains d_1..d_a and y_a, distributed as plain sampling from the target;
3. rolls back: each Gated DeltaNet state becomes the one after token a (the verification left the state
   after token k in the slot and the ones before in the history: a copy from there where a < k); the
   conv rings are long enough that nothing was lost, and keys/values past p+a are simply not counted;
4. catches the MTP head up on positions p..p+k with (target hidden h_{p+t}, token y_t) -- for t <= a, y_t
   is the token that really follows (d_{t+1}, then the final token) -- and drafts the next round's d'_1
   from row a, then d'_2..d'_k from the head's own hidden states at positions p+a+1..p+a+k-1 (argmax for
   greedy rows; sampled rows draw from the head's filtered distributions, which are kept for the next
   round's acceptance test in ``q``, by cache slot). Rows past a write MTP keys/values at positions the
   next round overwrites before anything reads them. Only row a goes on through the head's MoE (the
   other rows are needed for their keys/values alone).

Sampling parameters (temperature, top-k, top-p, min-p) and the round's uniforms ([b, 2k+1]: k acceptance
tests, the final token, k next drafts; drawn on the host from each sequence's generator) go in with the
other inputs; draws are by inverse CDF, so a graph is deterministic given its inputs. Three variants per
bucket: greedy only (argmax comparisons, no sampling work), sampled without top-k/top-p (no sort), and
sampled with a sort of each row (only when some sampled row asks for top-k or top-p); greedy rows ride
along in the sampled variants with their argmax results. Penalties and logprobs are not handled here:
those sequences use the module path's round (``MTPSpeculator.step_many``). Padded rows of a bucket point
at the runner's scratch slot.

The round ends by writing the next round's inputs into its own input buffers: x_p = y_a, the drafts it
made, p + a + 1 (padded rows stay at the scratch slot's position 0). So the next round of the same
sequences can be launched before this one's output reaches the host (``launch_chained``, the engine's
async scheduling): only sampled rows' uniforms go up, and the pages are reserved for the furthest the
round in flight can reach.
"""

from __future__ import annotations

import os
import random

import torch

from fp4moe.engine.device.transfer import Readback, to_device, upload
from fp4moe.engine.request.sampler import SamplingParams
from fp4moe.engine.spec.spec_sampling import accept_drafts, filter_probs, needs_sort, row_params, sample_rows

GREEDY, SAMPLED, SORTED = 0, 1, 2  # graph variants: all rows greedy; sampled rows, without / with a sort
PARAMS = 4  # sampling-buffer columns before the uniforms: temperature (0 = greedy), top_k, top_p, min_p


class FusedSpecRound:
    def __init__(self, runner, k: int):
        if runner.spec_tokens != k:
            raise ValueError(f"the runner was built for {runner.spec_tokens} speculative tokens, not {k}")
        self.runner, self.k, self.t = runner, k, k + 1
        n, dev = runner.max_num_seqs, runner.device
        self.vocab = runner.args.vocab_size
        self.ids = torch.zeros(n, self.t, dtype=torch.long, device=dev)  # x_p, d_1..d_k
        self.pos = torch.zeros(n, dtype=torch.int32, device=dev)  # p
        self.slots = torch.full((n,), runner.scratch, dtype=torch.int32, device=dev)
        self.delta = torch.zeros(n, dtype=torch.int32, device=dev)  # rotary position - cache position
        # per row: temperature, top_k, top_p, min_p, then uniforms for k acceptance tests, the final token
        # and k next drafts (one upload per round; the greedy variant never reads it)
        self.sampling = torch.zeros(n, PARAMS + 2 * k + 1, device=dev)
        # the distributions each sequence's current drafts were drawn from, by cache slot (the scratch slot
        # last): [max_num_seqs + 1, k, V] fp32, allocated when a sampled sequence first needs it
        self.q: torch.Tensor | None = None
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # the slots and graph variant of the round launched last (``launch_chained`` continues only that one)
        self.chain: tuple[tuple[int, ...], int] | None = None
        # benchmarks only (timing, not output): every sequence accepts ``forced[0]`` drafts; set before the
        # first round, since graphs are captured with or without it. FP4MOE_FORCE_ACCEPTANCE=ALPHA (a served
        # benchmark's switch) draws forced[0] per round: each draft position accepted with probability ALPHA
        # until the first rejection
        self.forced: torch.Tensor | None = None
        rate = os.environ.get("FP4MOE_FORCE_ACCEPTANCE")
        self.force_rate = float(rate) if rate else None
        if self.force_rate is not None:
            self.forced = torch.zeros(1, dtype=torch.long, device=dev)
            self._force_rng = random.Random(0)

    def __call__(self, slots: list[int], positions: list[int], *inputs, **options):
        """A whole round, waited for: ``launch`` then ``finish`` -> (accepted a [b], tokens y [b, k+1],
        next drafts [b, k]) as host tensors; the sequence gains y[:a+1]."""
        return self.finish(self.launch(slots, positions, *inputs, **options), positions)

    def launch(
        self,
        slots: list[int],
        positions: list[int],
        tokens: list[list[int]],
        deltas: list[int],
        sampling: tuple[list[SamplingParams], torch.Tensor] | None = None,
    ) -> tuple[Readback, list[int]]:
        """Start one round for ``len(slots)`` sequences (pending position p, tokens [x_p, d_1..d_k], rotary
        offset) on the GPU; its output [b, 1 + (k+1) + k] (a, y, next drafts) starts its way to the host
        (``finish`` reads it). Nothing here waits for the GPU. ``sampling``: None where every sequence is
        greedy, else (SamplingParams per sequence, uniforms [b, 2k+1] in [0, 1): k acceptance tests, the
        final token, k next drafts); the drafts of a sampled sequence must have been drawn from the
        distributions in ``q`` (this round's output, or ``set_draft_probs`` after drafting on the module
        path)."""
        r, b = self.runner, len(slots)
        mode = self._mode(sampling)
        for slot, p in zip(slots, positions, strict=True):
            r.kv.reserve(slot, p + 2 * self.k)  # verification to p+k, MTP drafts to p+2k-1
        bucket = r.graph_bucket(b)
        if bucket is not None and (bucket, mode) not in self.graphs:
            self._park()  # the warm-up round writes only the scratch slot
            self.graphs[bucket, mode] = r.graph_of(lambda: self.forward(bucket, mode))
        self._park()
        dev = self.pos.device
        self.slots[:b] = to_device(slots, torch.int32, dev)
        self.pos[:b] = to_device(positions, torch.int32, dev)
        self.delta[:b] = to_device(deltas, torch.int32, dev)
        self.ids[:b] = to_device(tokens, torch.long, dev)
        self.chain = (tuple(slots), mode)
        return self._run(slots, bucket, mode, sampling)

    def launch_chained(
        self,
        slots: list[int],
        reach: list[int],
        sampling: tuple[list[SamplingParams], torch.Tensor] | None = None,
    ) -> tuple[Readback, list[int]]:
        """The next round of the same sequences (the same slots, in the same order, as the round launched
        last) before that round's output reaches the host: every round leaves the next one's inputs in the
        buffers (x_p = y_a, the drafts it made, p + a + 1), so only the uniforms of sampled rows go up.
        ``reach``: per sequence, a length its pages must cover -- at least p + a + 1 + 2k of the round in
        flight, whose a the host does not know yet (so p + 3k + 1 at most)."""
        r, b = self.runner, len(slots)
        mode = self._mode(sampling)
        if self.chain != (tuple(slots), mode):
            raise RuntimeError("a chained round needs the same sequences, in order, as the round before it")
        for slot, length in zip(slots, reach, strict=True):
            r.kv.reserve(slot, length)
        return self._run(slots, r.graph_bucket(b), mode, sampling)

    def finish(
        self, handle: tuple[Readback, list[int]], positions: list[int], live: list[bool] | None = None
    ):
        """A launched round's (accepted a [b], tokens y [b, k+1], next drafts [b, k]) on the host (waits for
        that copy only); the caches of each sequence (pending position p in ``positions``) now hold p + a + 1
        positions. ``live``: False for rows whose sequence ended meanwhile (their slot may be free)."""
        readback, slots = handle
        out = readback.tensor()
        accepted, choices, drafts = out[:, 0], out[:, 1 : 1 + self.t], out[:, 1 + self.t :]
        for i, (p, a) in enumerate(zip(positions, accepted.tolist(), strict=True)):
            if live is None or live[i]:
                self.runner.kv.advance(slots[i], p + a + 1)
        return accepted, choices, drafts

    def _mode(self, sampling) -> int:
        if sampling is None or all(p.greedy for p in sampling[0]):
            return GREEDY
        self._allocate_q()
        return SORTED if needs_sort(sampling[0], self.vocab) else SAMPLED

    def _run(self, slots: list[int], bucket: int | None, mode: int, sampling) -> tuple[Readback, list[int]]:
        """The round over the buffers' first ``len(slots)`` rows (its graph where there is one) -> its
        output on the way to the host, and the slots (what ``finish`` takes)."""
        b = len(slots)
        if self.force_rate is not None:
            a = 0
            while a < self.k and self._force_rng.random() < self.force_rate:
                a += 1
            self.forced.fill_(a)
        if mode != GREEDY:
            params, uniforms = sampling
            columns = torch.tensor(row_params(params), dtype=torch.float32).T
            host = torch.cat([columns, uniforms.float().reshape(b, 2 * self.k + 1)], dim=1)
            self.sampling[:b] = upload(host, self.sampling.device)
        if bucket is not None:
            graph, out = self.graphs[bucket, mode]
            graph.replay()
        else:
            out = self.forward(b, mode)
        return Readback(out[:b]), slots

    def set_draft_probs(self, slots: list[int], logits: torch.Tensor, params: list[SamplingParams]) -> None:
        """Keep the distributions of drafts drawn elsewhere (the module path's first drafting): draft
        ``logits`` [n, k, V] of sampled sequences in ``slots``, filtered with their ``params``."""
        self._allocate_q()
        n, dev = len(slots), self.q.device
        rows = [torch.tensor(c, device=dev).repeat_interleave(self.k) for c in row_params(params)]
        probs = filter_probs(
            logits.reshape(n * self.k, -1).to(dev), *rows, sort=needs_sort(params, self.vocab)
        )
        self.q[torch.tensor(slots, device=dev)] = probs.view(n, self.k, -1)

    def _allocate_q(self) -> None:
        if self.q is None:
            r = self.runner
            self.q = torch.zeros(r.max_num_seqs + 1, self.k, self.vocab, device=r.device)

    def _park(self) -> None:
        """Every row at the scratch slot, position 0, greedy (the padding of a bucket)."""
        self.slots.fill_(self.runner.scratch)
        self.pos.zero_()
        self.delta.zero_()
        self.ids.zero_()
        self.sampling.zero_()

    def forward(self, b: int, mode: int = GREEDY) -> torch.Tensor:
        """The round over the first ``b`` buffer rows -> [b, 1 + (k+1) + k] int64: a, y, next drafts."""
        from fp4moe.kernels import gdn_decode as gdn_k

        r, t, k = self.runner, self.t, self.k
        model = r.model
        steps = torch.arange(t, device=self.pos.device, dtype=torch.int32)
        pos = (self.pos[:b, None] + steps).reshape(-1)
        slots = self.slots[:b].repeat_interleave(t)
        rope = (pos + self.delta[:b].repeat_interleave(t)).long().expand(3, -1)
        _, x = r.forward_rows(self.ids[:b].reshape(-1), pos, slots, rope, tokens_per_seq=t)
        logits = model.lm_head(x)
        choices = logits.argmax(-1).view(b, t)
        agree = (self.ids[:b, 1:] == choices[:, :-1]).long().cumprod(1)
        accepted = agree.sum(1)  # [b]
        if mode != GREEDY:  # sampled rows: rejection sampling against the kept draft distributions
            sampled = self.sampling[:b, 0] > 0
            u = self.sampling[:b, PARAMS:]
            p = self._filter(logits, b, mode, repeat=t).view(b, t, -1)
            q = self.q[self.slots[:b].long()]  # read before this round's drafts overwrite it
            a, final = accept_drafts(p, q, self.ids[:b, 1:], u[:, :k], u[:, k])
            accepted = torch.where(sampled, a, accepted)
            follow = torch.cat([self.ids[:b, 1:], final[:, None]], dim=1).scatter(
                1, a[:, None], final[:, None]
            )
            choices = torch.where(sampled[:, None], follow, choices)  # y_t for t <= a: what really follows
        if self.forced is not None:
            accepted = self.forced.expand(b)
        rows = torch.arange(b, device=pos.device) * t + accepted
        gdn_k.restore_states(r.history, r.states.rec, accepted, self.slots[:b], t)
        hidden = r.mtp_rows(choices.reshape(-1), x, pos, slots, rope, keep=rows)  # after the final token
        drafts = [self._draft(hidden, b, mode, 0)]
        for j in range(1, k):
            p = self.pos[:b] + accepted.int() + j
            hidden = r.mtp_rows(
                drafts[-1], hidden, p, self.slots[:b], (p + self.delta[:b]).long().expand(3, -1)
            )
            drafts.append(self._draft(hidden, b, mode, j))
        drafts = torch.stack(drafts, 1)
        # the next round's inputs, in place (``launch_chained``): x_p = y_a, the new drafts, p + a + 1 -- the
        # padding rows stay at the scratch slot's position 0
        final = choices.gather(1, accepted[:, None])
        real = self.slots[:b] != r.scratch
        self.ids[:b] = torch.cat([final, drafts], dim=1)
        self.pos[:b] += torch.where(real, accepted.int() + 1, 0)
        return torch.cat([accepted[:, None], choices, drafts], dim=1)

    def _filter(self, logits: torch.Tensor, b: int, mode: int, repeat: int = 1) -> torch.Tensor:
        """The sampler's distributions [b * repeat, V] of logits rows (``repeat`` consecutive rows per
        sequence), with each sequence's parameters from the sampling buffer."""
        temperature, top_k, top_p, min_p = (
            self.sampling[:b, i].repeat_interleave(repeat) if repeat > 1 else self.sampling[:b, i]
            for i in range(PARAMS)
        )
        return filter_probs(logits, temperature, top_k, top_p, min_p, sort=mode == SORTED)

    def _draft(self, hidden: torch.Tensor, b: int, mode: int, j: int) -> torch.Tensor:
        """Draft j of the next round from the MTP head's output: argmax for greedy rows; sampled rows draw
        from the filtered distribution, which goes into ``q`` for the next round's acceptance test."""
        model = self.runner.model
        if mode == GREEDY:
            return model.mtp.greedy(model, hidden)
        logits = model.mtp.logits(model, hidden)
        choice = logits.argmax(-1)
        q = self._filter(logits, b, mode)
        self.q[:, j].index_copy_(0, self.slots[:b].long(), q)
        drawn = sample_rows(q, self.sampling[:b, PARAMS + self.k + 1 + j])
        return torch.where(self.sampling[:b, 0] > 0, drawn, choice)
