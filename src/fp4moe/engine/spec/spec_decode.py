"""MTP speculative decoding on the reference engine: draft k tokens with the checkpoint's MTP head, verify
all k+1 positions in one target forward, keep the longest agreeing prefix plus one token from the target.

Greedy: a draft is accepted when it equals the token the target would pick (penalties included), so the
output is identical to plain decoding. Sampling: standard speculative rejection sampling (accept draft d
with probability min(1, p(d)/q(d)), else resample from max(0, p - q)), so the output distribution is the
target's. Rollback is by recompute: the Gated DeltaNet states of the verified slot are put back and the
accepted tokens are run again (attention caches are just truncated). The MTP head keeps its own KV cache
over the (token, target hidden) pairs of every accepted position, caught up before each draft.
Sequences decoding together share the forwards: one flat MTP forward per draft position, one flat target
forward to verify, one more for the kept tokens of the sequences that rejected a draft.

On the GPU runner, sequences without penalties and without logprobs -- greedy or sampled (temperature,
top-k, top-p, min-p) -- take the fused round instead (``engine.spec.cuda_spec``): verification, acceptance
(rejection sampling on the GPU for sampled ones, with uniforms drawn here from each sequence's generator),
rollback from per-token states and the next round's drafts in one captured graph; their drafts are made a
round ahead and kept on the sequence (``drafts``; the distributions sampled drafts came from stay on the
GPU, by cache slot). Sequences with penalties or logprobs keep the module path's round.

When a sequence drafts and when it backs off (its drafts, or its batch's rounds, do not pay) is the policy's
(``engine.spec.spec_policy``); this module runs the rounds.
"""

from __future__ import annotations

import torch

from fp4moe.engine.reference.context import StepContext
from fp4moe.engine.request.sampler import SampleResult, apply_penalties, filter_logits, sample, sample_result
from fp4moe.engine.request.sequence import Sequence
from fp4moe.engine.spec.spec_cost import SpecCost
from fp4moe.engine.spec.spec_policy import SpecPolicy
from fp4moe.engine.spec.spec_stats import SpecStats


def _probs(logits: torch.Tensor, seq: Sequence, history: list[int]) -> torch.Tensor:
    """The distribution the sampler draws from, for a sequence whose output so far is ``history``."""
    processed = apply_penalties(logits.float().clone(), seq.prompt_ids, history, seq.params)
    return filter_logits(processed, seq.params).softmax(-1)


class MTPSpeculator:
    def __init__(self, model, runner, sampler, num_speculative_tokens: int, drafter=None, name="the model"):
        """``model``'s MTP head drafts, ``runner`` (a ``ModelRunner`` or ``CudaModelRunner`` of that model)
        verifies, ``sampler`` (a ``TokenSampler``) samples and appends; ``name`` (the checkpoint) is what the
        error of a model without an MTP head names."""
        if model.mtp is None:
            raise ValueError(f"{name} has no MTP head (no mtp.* tensors): use num_speculative_tokens=0")
        if num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be at least 1 for speculative decoding")
        self.model, self.runner, self.sampler, self.k = model, runner, sampler, num_speculative_tokens
        self.drafter = drafter or self._mtp_drafts  # tests may force acceptance or rejection
        self.stats = SpecStats(accepted_per_position=[0] * num_speculative_tokens)
        self.disable_by_batch_size = 0  # > 0: no drafts while more sequences than this are decoding
        # sampled sequences with top-k / top-p on the GPU runner decode without drafts unless this is set:
        # their fused round sorts every vocabulary row and measured 1.11x at 80% acceptance at batch 1,
        # slower than plain decoding below ~70% (H200, BENCHMARKS.md)
        self.speculate_sorted_sampling = False
        self.fused = None
        if runner.spec_tokens == num_speculative_tokens:
            from fp4moe.engine.spec.cuda_spec import FusedSpecRound

            self.fused = FusedSpecRound(runner, num_speculative_tokens)
        # when sequences draft and when they back off; rounds and plain steps are timed (``SpecCost``) only
        # where the fused round runs on the GPU
        self.policy = SpecPolicy(SpecCost(self.fused is not None and runner.device.type == "cuda"))

    @torch.no_grad()
    def run_batch(self, batch: list[tuple[Sequence, int]], kv, states, max_model_len: int) -> list[Sequence]:
        """A scheduled batch with speculation: prefill chunks in one flat forward (their hidden states kept
        for the head), then a draft-and-verify round for every decoding sequence (each one's ``new_tokens``
        set); returns the sequences that progressed."""
        decoding = [
            s for s, n in batch if n == 1 and s.num_cached == s.num_tokens - 1 and s.hidden_tail is not None
        ]
        prefill = [(s, n) for s, n in batch if s not in decoding]
        progressed = self.prefill(prefill, kv, states) if prefill else []
        if self.disable_by_batch_size and len(decoding) > self.disable_by_batch_size:
            # under load one batched plain step beats per-sequence draft-and-verify; the head keeps its
            # inputs (hidden states) and catches up when the batch shrinks again
            self.stats.disabled_steps += 1
            self.plain_steps(decoding, kv, states)  # drafts kept for the fused round are dropped
            for seq in decoding:
                seq.new_tokens = 1
            return progressed + decoding
        for seq, n in zip(decoding, self.decode_round(decoding, kv, states, max_model_len), strict=True):
            seq.new_tokens = n
        return progressed + decoding

    @torch.no_grad()
    def prefill(self, batch: list[tuple[Sequence, int]], kv, states) -> list[Sequence]:
        """Prompt chunks (sequence, tokens) through the runner's step (``ModelRunner.run``), their hidden
        states kept for the MTP head; samples the first token of each sequence whose prompt is now all in.
        Returns those."""
        results = self.runner.run(batch, kv, states, keep=self._keep_chunk)
        for seq, _ in results:
            seq.new_tokens = 1
            if not seq.output_ids:  # a fresh request: it may start backed off
                self.policy.start(seq, self.stats)
        self.sampler.sample_all(results)
        return [seq for seq, _ in results]

    @staticmethod
    def _keep_chunk(seq: Sequence, start: int, rows: torch.Tensor) -> None:
        """A chunk's hidden states [n, H] from position ``start`` join the MTP head's inputs."""
        if start == 0 or seq.hidden_tail is None:
            # fresh (or restored from a prefix snapshot: the MTP head starts after the restored part)
            seq.hidden_tail, seq.mtp_cached = rows[:0], start
            seq.drafts = None
        seq.hidden_tail = torch.cat([seq.hidden_tail, rows])

    def _mtp_drafts(self, seq: Sequence, kv, states) -> tuple[list[int], list[torch.Tensor]]:
        """Catch the MTP head up on the accepted positions, then draft k tokens; returns drafts and the
        draft logits each was chosen from. The draft entries of the MTP cache are dropped afterwards."""
        return self._mtp_drafts_many([seq], kv, states)[0]

    def _mtp_drafts_many(
        self, seqs: list[Sequence], kv, states
    ) -> list[tuple[list[int], list[torch.Tensor]]]:
        """``_mtp_drafts`` for several sequences at once: one flat MTP forward catches every sequence up,
        then each of the k-1 further drafts is one forward over all of them."""
        mtp, layer, device, k = self.model.mtp, self.model.mtp.layer_id, self.runner.device, self.k
        ps = [seq.num_tokens - 1 for seq in seqs]
        lens = [p - seq.mtp_cached for seq, p in zip(seqs, ps, strict=True)]
        ids = torch.tensor(
            [t for seq, p in zip(seqs, ps, strict=True) for t in seq.tokens(seq.mtp_cached + 1, p + 1)],
            device=device,
        )
        positions = torch.cat(
            [seq.positions(seq.mtp_cached, seq.mtp_cached + n) for seq, n in zip(seqs, lens, strict=True)],
            dim=1,
        )  # of h_t (vLLM)
        ctx = StepContext(lens, [seq.mtp_cached for seq in seqs], [seq.slot for seq in seqs], kv, states)
        h = mtp(self.model, ids, torch.cat([seq.hidden_tail for seq in seqs]), positions.to(device), ctx)
        last = h[torch.tensor([end - 1 for _, end in ctx.spans()], device=device)]
        for seq, p in zip(seqs, ps, strict=True):
            seq.mtp_cached = p
        drafts = [[] for _ in seqs]
        logits = [[] for _ in seqs]
        histories = [list(seq.output_ids) for seq in seqs]
        for j in range(k):
            rows = self.model.mtp.logits(self.model, last).float().cpu()
            for i, seq in enumerate(seqs):
                token = sample(rows[i], seq.prompt_ids, histories[i], seq.params, seq.generator).token_id
                drafts[i].append(token)
                logits[i].append(rows[i])
                histories[i].append(token)
            if j + 1 < k:  # feed the drafts with the head's own hidden states
                ctx = StepContext(
                    [1] * len(seqs), [p + j for p in ps], [seq.slot for seq in seqs], kv, states
                )
                ids = torch.tensor([d[-1] for d in drafts], device=device)
                positions = torch.cat(
                    [seq.positions(p + j, p + j + 1) for seq, p in zip(seqs, ps, strict=True)], dim=1
                )
                last = mtp(self.model, ids, last, positions.to(device), ctx)
        for seq, p in zip(seqs, ps, strict=True):
            kv.truncate(layer, seq.slot, p)
        return list(zip(drafts, logits, strict=True))

    def _verify(
        self, seq: Sequence, drafts: list[int], draft_logits: list[torch.Tensor], target: torch.Tensor
    ) -> list[int]:
        """Tokens to append: the accepted drafts and one token from the target."""
        history = list(seq.output_ids)
        out = []
        for j, d in enumerate(drafts):
            if seq.params.greedy:
                choice = sample(target[j], seq.prompt_ids, history, seq.params, None).token_id
                if choice != d:
                    return out + [choice]
            else:
                p = _probs(target[j], seq, history)
                q = _probs(draft_logits[j], seq, history)
                u = torch.rand((), generator=seq.generator)
                if u * q[d] > p[d]:  # reject: resample from the residual
                    residual = torch.clamp(p - q, min=0)
                    residual = residual / residual.sum() if residual.sum() > 0 else p
                    return out + [int(torch.multinomial(residual, 1, generator=seq.generator))]
            out.append(d)
            history.append(d)
        bonus = sample(target[len(drafts)], seq.prompt_ids, history, seq.params, seq.generator).token_id
        return out + [bonus]

    @torch.no_grad()
    def decode_round(self, seqs: list[Sequence], kv, states, max_model_len: int) -> list[int]:
        """One round for decoding sequences: draft-and-verify where k+1 more tokens fit in the context,
        a plain step where they do not; returns the tokens each sequence appended."""
        room = [s for s in seqs if s.num_tokens + self.k + 1 < max_model_len and not self.plain_only(s, kv)]
        for s in [s for s in room if s.spec_backoff > 0]:  # drafting did not pay lately: plain steps
            s.spec_backoff -= 1
            room.remove(s)
        fused = [s for s in room if self._fusable(s, kv, max_model_len)]
        # the module path's round needs positions the MTP head has not seen: a sequence fresh from a fused
        # round (drafts held, nothing to catch up; possible near the context end for k >= 4) steps plainly
        rest = [s for s in room if s not in fused and s.drafts is None]
        counts = dict(zip(map(id, fused), self.fused_round(fused, kv, states) if fused else [], strict=True))
        counts.update(zip(map(id, rest), self.step_many(rest, kv, states) if rest else [], strict=True))
        for s in rest:  # the module path's round: back off where the drafts do not pay (``finish_round``
            self.policy.judge(s, counts[id(s)] - 1, self.stats)  # judges the fused round's)
        plain = [seq for seq in seqs if id(seq) not in counts]
        if plain:
            self.plain_steps(plain, kv, states)
            counts.update((id(seq), 1) for seq in plain)
        return [counts[id(seq)] for seq in seqs]

    def forget(self) -> None:
        """Drop the counts and the latest rounds (after the server's warm-up, whose rounds are not the
        server's: left in the policy's ``recent`` they judge the first requests. On the H200 every served
        request with a rejected head started with probe rounds, 9% at tg 128, with the warm-up's rounds kept
        there)."""
        self.stats = SpecStats(accepted_per_position=[0] * self.k)
        self.policy.forget()

    def plain_only(self, seq: Sequence, kv) -> bool:
        """Sampled with top-k or top-p on the GPU runner (unless ``speculate_sorted_sampling``): the sequence
        decodes without drafts, its fused round costing more than it gains."""
        from fp4moe.engine.spec.spec_sampling import needs_sort

        return (
            self.fused is not None
            and not self.speculate_sorted_sampling
            and kv is self.runner.kv
            and needs_sort([seq.params], self.model.args.vocab_size)
        )

    def _fusable(self, seq: Sequence, kv, max_model_len: int) -> bool:
        """Whether the sequence can take the GPU runner's fused round: greedy or sampled (temperature, top-k,
        top-p, min-p), but no penalties (they depend on the history the round extends) and no logprobs
        (the round returns tokens only) -- those take the module path's round."""
        p = seq.params
        return (
            self.fused is not None
            and self.drafter == self._mtp_drafts
            and kv is self.runner.kv
            and p.logprobs is None
            and not p.penalized
            and seq.num_tokens - 1 + 2 * self.k <= max_model_len  # its MTP drafts reach p + 2k - 1
            and (not kv.fp8 or all(layer in kv.scales for layer in kv.index))
        )

    @torch.no_grad()
    def fused_round(self, seqs: list[Sequence], kv, states) -> list[int]:
        """The GPU runner's fused round for ``seqs`` (drafted first through the module path where they hold
        no drafts yet: after prefill or a plain step; the distributions sampled drafts were drawn from go to
        the round's buffer); returns the tokens each appended. Sampled sequences get 2k+1 uniforms a round
        from their own generator (seeded requests stay reproducible)."""
        greedy = [s for s in seqs if s.drafts is None and s.params.greedy]
        for seq, drafts in zip(greedy, self._first_drafts(greedy, kv) if greedy else [], strict=True):
            seq.drafts = drafts
        fresh = [s for s in seqs if s.drafts is None]
        proposals = self._mtp_drafts_many(fresh, kv, states) if fresh else []
        for seq, (drafts, _) in zip(fresh, proposals, strict=True):
            seq.drafts = drafts
        sampled = [
            (s, logits) for s, (_, logits) in zip(fresh, proposals, strict=True) if not s.params.greedy
        ]
        if sampled:
            self.fused.set_draft_probs(
                [s.slot for s, _ in sampled],
                torch.stack([torch.stack(logits) for _, logits in sampled]),
                [s.params for s, _ in sampled],
            )
        ps = [s.num_tokens - 1 for s in seqs]
        return self.finish_round(seqs, ps, self.launch_round(seqs))

    def _first_drafts(self, seqs: list[Sequence], kv) -> list[list[int]]:
        """Greedy first drafts of sequences fresh from their prompt (or from plain steps) on the GPU runner's
        fused MTP rows (``CudaModelRunner.mtp_rows``): the head catches up on every position it has not
        seen -- keys and values stored for all of them, only each sequence's last row on through the MoE --
        then drafts k tokens, read back once. ``_mtp_drafts_many`` does the same on the module path: every
        row through the MoE and a read-back per draft, 18-31 ms at pp 512 on the H200 (about ten plain
        steps) before each request's first round. Sampled sequences keep it: their drafts are drawn on the
        host with their own generators. A fresh prompt's catch-up replays a graph (``FirstDrafts``)."""
        r, k = self.runner, self.k
        ps = [s.num_tokens - 1 for s in seqs]
        lens = [p - s.mtp_cached for s, p in zip(seqs, ps, strict=True)]
        if any(n <= 0 or n != len(s.hidden_tail) for s, n in zip(seqs, lens, strict=True)):
            raise RuntimeError("the MTP head's inputs do not cover the positions it has not seen")
        for s, p in zip(seqs, ps, strict=True):
            kv.reserve(s.slot, p + k)  # the catch-up to p - 1, the drafts' rows to p + k - 2
        drafts = r.first_drafts(seqs, ps)
        layer = self.model.mtp.layer_id
        for s, p in zip(seqs, ps, strict=True):  # the head holds positions < p; the round overwrites drafts
            kv.advance(s.slot, p, layers=[layer])
            s.mtp_cached, s.hidden_tail = p, s.hidden_tail[:0]
        return drafts.tolist()

    def _uniforms(self, seqs: list[Sequence]):
        """The fused round's sampling input: None where every sequence is greedy, else (parameters, 2k+1
        uniforms per sequence from its own generator: seeded requests stay reproducible)."""
        if all(s.params.greedy for s in seqs):
            return None
        n = 2 * self.k + 1
        uniforms = torch.stack([
            torch.zeros(n) if s.params.greedy else torch.rand(n, generator=s.generator) for s in seqs
        ])  # fmt: skip
        return [s.params for s in seqs], uniforms

    def launch_round(self, seqs: list[Sequence], chained: bool = False):
        """Start a fused round for ``seqs`` (each holding its drafts) on the GPU; ``chained``: the round that
        follows the one in flight for the same sequences, whose tokens the host has not seen (its inputs
        are on the GPU already). Returns what ``finish_round`` reads."""
        slots = [s.slot for s in seqs]
        with self.policy.cost.timed("round", len(seqs)):
            if chained:  # the round in flight may advance a sequence by k+1 before this one's 2k positions
                return self.fused.launch_chained(
                    slots, [s.num_tokens + 3 * self.k for s in seqs], self._uniforms(seqs)
                )
            return self.fused.launch(
                slots,
                [s.num_tokens - 1 for s in seqs],
                [[s.token(-1), *s.drafts] for s in seqs],
                [s.rope_delta for s in seqs],
                self._uniforms(seqs),
            )

    def finish_round(
        self, seqs: list[Sequence], ps: list[int], handle, live: list[bool] | None = None
    ) -> list[int]:
        """A launched round's tokens appended (``ps``: each sequence's pending position when the round ran,
        ``live``: False for sequences that ended meanwhile, which get nothing); the acceptance counted and
        judged (``SpecPolicy.judge``), and the round's cost at its batch size (``SpecPolicy.judge_batch``).
        Returns the tokens each sequence appended."""
        accepted, choices, drafts = self.fused.finish(handle, ps, live)
        appended, kept = [], []
        for i, (seq, p) in enumerate(zip(seqs, ps, strict=True)):
            if live is not None and not live[i]:
                appended.append(0)
                continue
            a = int(accepted[i])
            self.stats.record(self.k, a)
            seq.num_cached = seq.mtp_cached = p + a + 1
            seq.hidden_tail = seq.hidden_tail[:0]  # the MTP head has seen every kept position
            seq.drafts = drafts[i].tolist()
            appended.append(self._append(seq, [SampleResult(t) for t in choices[i, : a + 1].tolist()]))
            self.policy.judge(seq, a, self.stats)
            kept.append((seq, a + 1))
        self.policy.judge_batch(len(seqs), kept, self.stats)
        return appended

    def _append(self, seq: Sequence, results) -> int:
        """Append a round's tokens (SampleResults) until a stop; sets the sequence's text delta; returns how
        many went in."""
        before = len(seq.output_ids)
        self.sampler.extend(seq, results)
        return len(seq.output_ids) - before

    @torch.no_grad()
    def step(self, seq: Sequence, kv, states) -> int:
        """One draft-and-verify round for a decoding sequence; returns the tokens it appended."""
        return self.step_many([seq], kv, states)[0]

    @torch.no_grad()
    def step_many(self, seqs: list[Sequence], kv, states) -> list[int]:
        """One draft-and-verify round for each of ``seqs``: the MTP head drafts for all of them (flat
        forwards), then one flat target forward verifies every sequence's k+1 positions, and one more
        recomputes the kept part of the sequences that rejected a draft (their DeltaNet states restored, KV
        truncated). Returns the number of tokens each sequence appended (fewer than accepted + 1 where a
        stop ends it)."""
        rounds = []
        for seq in seqs:
            seq.drafts = None  # this round drafts afresh (drafts kept on a sequence are the fused round's)
        if self.drafter == self._mtp_drafts:
            proposals = self._mtp_drafts_many(seqs, kv, states)
        else:  # a custom drafter (tests force acceptance or rejection): one sequence at a time
            proposals = [self.drafter(seq, kv, states) for seq in seqs]
        for seq, (drafts, draft_logits) in zip(seqs, proposals, strict=True):
            p = seq.num_tokens - 1  # position of the pending (sampled, uncached) token
            tokens = [seq.token(-1), *drafts]
            rounds.append((seq, p, tokens, drafts, draft_logits, states.snapshot(seq.slot)))
        hidden, spans = self._forward([(seq, p, tokens) for seq, p, tokens, *_ in rounds], kv, states)
        target = self.model.compute_logits(hidden).cpu()  # [sum(k+1), V]
        redo, done = [], []
        for (seq, p, tokens, drafts, draft_logits, snapshot), (start, end) in zip(rounds, spans, strict=True):
            new = self._verify(seq, drafts, draft_logits, target[start:end])
            accepted = len(new) - 1
            self.stats.record(len(drafts), accepted)
            if accepted < len(
                drafts
            ):  # roll back: restore DeltaNet states, drop the KV, recompute the kept part
                states.restore(seq.slot, snapshot)
                for layer in range(self.model.args.num_layers):
                    kv.truncate(layer, seq.slot, p)
                redo.append((seq, p, tokens[: accepted + 1]))
            else:
                seq.hidden_tail = hidden[start:end]
            done.append((seq, p, new, target[start:end]))
        if redo:
            kept, kept_spans = self._forward(redo, kv, states)
            for (seq, _, _), (start, end) in zip(redo, kept_spans, strict=True):
                seq.hidden_tail = kept[start:end]
        appended = []
        for seq, p, new, target_rows in done:
            seq.num_cached = p + len(new)
            results = (sample_result(token, target_rows[j], seq.params) for j, token in enumerate(new))
            appended.append(self._append(seq, results))
        return appended

    def _forward(self, items: list[tuple[Sequence, int, list[int]]], kv, states):
        """One flat target forward over (sequence, first position, tokens) items -> (hidden, spans)."""
        device = self.runner.device
        ids = torch.tensor([t for _, _, tokens in items for t in tokens], device=device)
        positions = torch.cat([seq.positions(p, p + len(tokens)) for seq, p, tokens in items], dim=1)
        ctx = StepContext(
            [len(tokens) for _, _, tokens in items], [p for _, p, _ in items], [seq.slot for seq, _, _ in items],
            kv, states,
        )  # fmt: skip
        return self.model(ids, positions.to(device), ctx), ctx.spans()

    @torch.no_grad()
    def plain_steps(self, seqs: list[Sequence], kv, states) -> None:
        """One ordinary decode step for each of ``seqs`` (near the end of the context, under load, or
        sampled with a sort) through the runner's step -- on the GPU runner its fused, graph-captured step --
        keeping the MTP head's inputs, except for sequences that never draft (``plain_only``: they drop them;
        their sampling parameters, and ``speculate_sorted_sampling``, do not change while they run)."""
        with self.policy.cost.timed("plain", len(seqs)):
            results = self.runner.run(
                [(s, 1) for s in seqs],
                kv,
                states,
                keep=lambda seq, start, rows: self._keep_plain(seq, start + len(rows), rows, kv),
            )
        self.sampler.sample_all(results)

    def keep_plain_step(self, seqs: list[Sequence], hidden: torch.Tensor, kv=None) -> None:
        """After a plain step of ``seqs`` (final-normed hidden states [b, H], row per sequence; the engine's
        async steps): as ``plain_steps`` keeps them."""
        kv = self.runner.kv if kv is None else kv
        for i, seq in enumerate(seqs):
            self._keep_plain(seq, seq.num_cached, hidden[i : i + 1], kv)

    def _keep_plain(self, seq: Sequence, end: int, rows: torch.Tensor, kv) -> None:
        """Drafts held for a fused round are dropped; the MTP head's inputs grow by the step's position
        (``rows`` [1, H]), or are dropped for a sequence that never drafts (``plain_only``: the head's cache
        then starts at ``end``, the position after this step)."""
        seq.drafts = None
        if self.plain_only(seq, kv):
            seq.hidden_tail, seq.mtp_cached = rows[:0], end
        else:
            seq.hidden_tail = torch.cat([seq.hidden_tail, rows])
