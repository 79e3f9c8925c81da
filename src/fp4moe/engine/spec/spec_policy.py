"""Speculation's policy (``SpecPolicy``): when a sequence, a batch or a fresh request drafts and when it backs
off -- judged on the drafts the latest rounds accepted, and on what rounds cost against plain steps at their
batch size (``SpecCost``). ``MTPSpeculator`` (``engine.spec.spec_decode``) runs the rounds and asks it.

PROBE_ROUNDS, JUDGED_ROUNDS, MIN_ACCEPTED and BACKOFF_STEPS are read at each judgement, not bound when the
policy is made: tests shorten the phases by patching them."""

from __future__ import annotations

from collections import deque

from fp4moe.engine.request.sequence import Sequence
from fp4moe.engine.spec.spec_cost import SpecCost
from fp4moe.engine.spec.spec_stats import SpecStats

# The fused round's online policy: every PROBE_ROUNDS rounds a sequence whose latest rounds (up to
# JUDGED_ROUNDS of them since its last probe began) accepted less than MIN_ACCEPTED drafts a round decodes
# plainly for BACKOFF_STEPS steps, then probes again. A round with k = 2 costs ~1.9 plain steps at batch 1
# and ~1.4 at batch 8-32 on the H200 (BENCHMARKS.md), so it pays from ~0.9 and ~0.4 accepted drafts a round:
# 0.5 keeps speculation wherever it can pay under load and stops a head whose drafts are rejected (0%
# acceptance) after 4 rounds; probing then costs ~4 rounds in 260 steps (< 2%). Judging the latest 16
# rounds, not only the last 4, keeps a good head from backing off on a bad streak: at 80% acceptance per
# position (1.44 drafts a round) 4 rounds fall below 2 accepted with probability 0.7%, which over a
# 1,024-token request (~80 windows) backed off 43% of requests for 256 steps (H200, BENCHMARKS.md); 16
# rounds fall below 8 with probability ~1e-6.
PROBE_ROUNDS = 4
JUDGED_ROUNDS = 16
MIN_ACCEPTED = 0.5
BACKOFF_STEPS = 256

# ... and a request that arrives while the last RECENT_ROUNDS rounds (of any sequence) accepted less than
# MIN_ACCEPTED a round starts backed off: a head that keeps failing on this server costs new requests no
# probe rounds (at one stream on the H200 they cost a 128-token request 12%), only the probes every
# BACKOFF_STEPS steps, whose rounds keep the window current
RECENT_ROUNDS = 64


def _pays(accepted) -> bool:
    """Whether rounds that accepted these numbers of drafts paid: MIN_ACCEPTED a round or more."""
    return sum(accepted) >= MIN_ACCEPTED * len(accepted)


class SpecPolicy:
    """The speculator's judge: it keeps the latest rounds' acceptance (``recent``) and the rounds' and plain
    steps' times (``cost``), and sets a sequence's backoff (``Sequence.spec_backoff``: plain steps before it
    drafts again). Its events are counted in the ``SpecStats`` each judgement is given -- the speculator's
    current ones (``MTPSpeculator.forget`` replaces them)."""

    def __init__(self, cost: SpecCost):
        # the fused rounds' and plain steps' GPU times by batch size: whether rounds pay at their batch
        self.cost = cost
        self.recent: deque[int] = deque(maxlen=RECENT_ROUNDS)  # accepted drafts of the latest rounds

    def judge(self, seq: Sequence, accepted: int, stats: SpecStats) -> None:
        """Count a round's accepted drafts; every PROBE_ROUNDS rounds, back off when the latest rounds (up to
        JUDGED_ROUNDS since the probe began) do not pay."""
        seq.spec_rounds += 1
        seq.spec_accepted = [*seq.spec_accepted[1 - JUDGED_ROUNDS :], accepted]
        self.recent.append(accepted)
        if seq.spec_rounds >= PROBE_ROUNDS:
            if not _pays(seq.spec_accepted):
                seq.spec_backoff = BACKOFF_STEPS
                seq.spec_accepted = []  # the next probe is judged on its own rounds
                stats.backed_off += 1
            seq.spec_rounds = 0

    def may_back_off(self, seq: Sequence) -> bool:
        """Whether the sequence's round in flight (not yet judged) may end with a backoff, should it accept
        nothing: the next round is then not launched ahead of it (it may be a round the policy stops)."""
        return seq.spec_rounds + 1 >= PROBE_ROUNDS and not _pays([*seq.spec_accepted[1 - JUDGED_ROUNDS :], 0])

    def head_pays(self) -> bool:
        """Whether the latest rounds accepted enough drafts to pay (true until PROBE_ROUNDS rounds ran)."""
        return len(self.recent) < PROBE_ROUNDS or _pays(self.recent)

    def start(self, seq: Sequence, stats: SpecStats) -> None:
        """A fresh request (its first token about to be sampled) starts backed off while the head does not
        pay: no probe rounds while the head fails."""
        if not self.head_pays():
            seq.spec_backoff = BACKOFF_STEPS
            stats.started_backed_off += 1

    def judge_batch(self, n: int, kept: list[tuple[Sequence, int]], stats: SpecStats) -> None:
        """After a fused round of ``n`` sequences (``kept``: the live ones and the tokens each kept): where
        rounds at this batch size lose to plain steps, its sequences back off (``SpecCost.verdict``); where
        the plain steps' time at this size is missing or stale, they take one plain step."""
        if not kept:
            return
        verdict = self.cost.verdict(n, sum(t for _, t in kept) / len(kept))
        if verdict is None:
            return
        if verdict == "loses":
            stats.batch_backoffs += 1
        else:
            stats.plain_probes += 1
        for seq, _ in kept:
            if verdict == "loses":  # its own rounds are judged afresh when it drafts again
                seq.spec_backoff, seq.spec_rounds, seq.spec_accepted = BACKOFF_STEPS, 0, []
            else:
                seq.spec_backoff = max(seq.spec_backoff, 1)

    def forget(self) -> None:
        """Drop the latest rounds: a new request is judged on rounds that follow (after the server's warm-up,
        or at each ``LLM.generate`` call)."""
        self.recent.clear()
