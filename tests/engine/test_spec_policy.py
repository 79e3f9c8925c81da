"""Speculation's policy (``SpecPolicy``): when a sequence drafts and when it backs off, judged on the drafts
its latest rounds accepted; whether a fresh request starts backed off, judged on the latest rounds of all.
The batch judgement (what rounds cost at their batch) is tests/engine/test_spec_cost.py's and, end to end,
tests/engine/test_cuda_spec.py's."""

from fp4moe.engine.request.sampler import SamplingParams
from fp4moe.engine.request.sequence import Sequence
from fp4moe.engine.spec import spec_policy
from fp4moe.engine.spec.spec_cost import SpecCost
from fp4moe.engine.spec.spec_policy import SpecPolicy
from fp4moe.engine.spec.spec_stats import SpecStats

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


def test_the_fused_round_policy_backs_off_where_drafts_do_not_pay():
    """Every PROBE_ROUNDS fused rounds a sequence whose latest rounds (up to JUDGED_ROUNDS) accepted fewer
    than MIN_ACCEPTED drafts a round decodes plainly for BACKOFF_STEPS steps, then probes again; one that
    accepts keeps drafting, through a bad streak of PROBE_ROUNDS rounds too."""
    probe, judged = spec_policy.PROBE_ROUNDS, spec_policy.JUDGED_ROUNDS
    policy, stats = SpecPolicy(SpecCost(False)), SpecStats(accepted_per_position=[0, 0])
    good, bad = Sequence(0, [1], GREEDY, 0), Sequence(1, [1], GREEDY, 1)
    for _ in range(3 * probe):
        policy.judge(good, 1, stats)  # 1 of 2 drafts a round: pays
    for _ in range(probe):
        policy.judge(good, 0, stats)  # a streak of rejections: the 16 latest rounds still pay
    assert good.spec_backoff == 0 and stats.backed_off == 0 and len(good.spec_accepted) == judged
    for _ in range(probe - 1):
        policy.judge(bad, 0, stats)
    assert bad.spec_backoff == 0  # still probing
    policy.judge(bad, 1, stats)  # 1 accepted in 4 rounds: 0.25 a round
    assert bad.spec_backoff == spec_policy.BACKOFF_STEPS and stats.backed_off == 1
    assert (bad.spec_rounds, bad.spec_accepted) == (0, [])  # a fresh window for the next probe
    # async scheduling launches no round ahead of one that may end with a backoff
    may = policy.may_back_off
    assert not may(bad) and not may(good)  # rounds left before the next judgement
    bad.spec_rounds, bad.spec_accepted = probe - 1, [0, 0, 0]
    assert may(bad)  # nothing accepted yet: the round in flight decides
    bad.spec_accepted = [1, 1, 0]
    assert not may(bad)  # it passes whatever the round in flight accepts
    good.spec_rounds = probe - 1
    assert not may(good)  # 11 accepted in the 15 rounds the judgement keeps
    good.spec_accepted = [0] * judged
    assert may(good)
    bad.spec_rounds, bad.spec_accepted = 0, []
    # the latest rounds of all sequences: whether a new request starts drafting or backed off
    assert list(policy.recent) == [1] * 3 * probe + [0] * probe + [0, 0, 0, 1] and policy.head_pays()
    fresh = Sequence(2, [1], GREEDY, 2)
    policy.start(fresh, stats)
    assert fresh.spec_backoff == 0 and stats.started_backed_off == 0
    policy.forget()
    policy.recent.extend([0, 1, 0, 0])
    assert not policy.head_pays()  # 0.25 accepted a round
    policy.start(fresh, stats)
    assert fresh.spec_backoff == spec_policy.BACKOFF_STEPS and stats.started_backed_off == 1
    policy.forget()
    policy.recent.extend([0, 0])
    assert policy.head_pays()  # too few rounds to judge
