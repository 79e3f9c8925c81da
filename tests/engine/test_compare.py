"""The near-tie-aware comparison of two engines' greedy outputs (used by the GPU gate and tests)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fp4moe.engine.reference.compare import RouterMargins, greedy_agreement


def _output(steps):
    """steps: (token, logprob, top-2 logprobs) per step -> a RequestOutput-like object."""
    logprobs = [
        SimpleNamespace(token_id=t, logprob=lp, top_logprobs={t: lp, -1: second}) for t, lp, second in steps
    ]
    return SimpleNamespace(outputs=[SimpleNamespace(logprobs=logprobs, token_ids=[t for t, _, _ in steps])])


REF = _output([(1, -0.5, -2.0), (2, -0.3, -3.0), (3, -0.2, -2.5), (4, -0.4, -2.0)])


def test_identical_outputs_agree():
    a = greedy_agreement([REF], [REF])
    assert a.ok and a.identical and a.max_logprob_diff == 0


def test_a_split_without_a_near_tie_fails_and_a_logprob_jump_fails():
    wrong_token = _output([(1, -0.5, -2.0), (9, -0.3, -3.0), (3, -0.2, -2.5), (4, -0.4, -2.0)])
    assert not greedy_agreement([REF], [wrong_token]).ok
    jump = _output([(1, -0.5, -2.0), (2, -0.9, -3.0), (3, -0.2, -2.5), (4, -0.4, -2.0)])
    assert not greedy_agreement([REF], [jump]).ok


def test_a_divergence_after_a_router_near_tie_is_excused_before_it_is_not():
    jump = _output([(1, -0.5, -2.0), (2, -0.3, -3.0), (3, -0.9, -2.5), (4, -0.4, -2.0)])
    tie_at_2 = [[0.5, 0.4, 0.001, 0.3]]  # the reference's router was nearly tied in the forward of step 2
    a = greedy_agreement([REF], [jump], router_margins=tie_at_2, min_compared=0.5)
    assert a.ok and a.router_tie_splits == 1 and (a.compared, a.checkable) == (2, 2)
    tie_at_3 = [[0.5, 0.4, 0.3, 0.001]]  # a tie later does not excuse step 2
    assert not greedy_agreement([REF], [jump], router_margins=tie_at_3, min_compared=0.5).ok
    # the floor: excused from step 2 on, 2 of 4 tokens compared
    a = greedy_agreement([REF], [jump], router_margins=tie_at_2, min_compared=0.75)
    assert not a.ok and "only 2 of 4 tokens compared" in a.detail
    with pytest.raises(ValueError, match="min_compared"):
        greedy_agreement([REF], [jump], router_margins=tie_at_2)


def test_router_margins_recorded_per_forward():
    import torch

    from fp4moe.layers.moe import SparseMoE

    moe = SparseMoE(8, 4, 2, 4, 4)
    with torch.no_grad():
        moe.gate.weight.copy_(torch.cat([torch.eye(4), torch.zeros(4, 4)], 1))  # logits = x[:4]
    original = SparseMoE.route
    rm = RouterMargins(num_moe_layers=1)
    with rm:
        moe.route(torch.tensor([[3.0, 2.0, 1.0, 0.0, 0, 0, 0, 0]]))
        moe.route(torch.tensor([[3.0, 2.0, 1.5, 0.0, 0, 0, 0, 0], [3.0, 2.0, 2.0, 1.9, 0, 0, 0, 0]]))
    assert SparseMoE.route is original  # restored
    assert rm.forwards == [1.0, 0.0]  # gap between the 2nd and 3rd logit; the smallest over rows


def test_a_shorter_output_fails_and_counts_say_what_was_compared():
    """A 1-of-4-token output (passed while the comparison zipped without checking lengths) and a longer
    one fail; the agreement says how many tokens it really compared."""
    first_only = _output([(1, -0.5, -2.0)])
    a = greedy_agreement([REF], [first_only])
    assert not a.ok and "1 tokens where the reference has 4" in a.detail
    longer = _output([(1, -0.5, -2.0), (2, -0.3, -3.0), (3, -0.2, -2.5), (4, -0.4, -2.0), (5, -1.0, -2.0)])
    assert not greedy_agreement([REF], [longer]).ok
    assert not greedy_agreement([REF], [[1, 2, 3]]).ok  # token ids alone, one short
    a = greedy_agreement([REF, REF], [REF, [1, 2, 3, 4]])
    assert a.ok and a.identical and (a.compared, a.total) == (8, 8)
    with pytest.raises(ValueError, match="1 outputs to compare with 2"):
        greedy_agreement([REF, REF], [REF])


def test_a_near_tie_split_ends_only_its_own_sequence():
    tied = _output([(1, -0.5, -2.0), (2, -0.70, -0.72), (3, -0.2, -2.5), (4, -0.4, -2.0)])
    parted = [1, 7, 9]  # parts at the tie, then ends early: the rest is another text, excused
    a = greedy_agreement([tied, REF], [parted, [1, 2, 3, 4]])
    assert a.ok and not a.identical and a.near_tie_splits == 1
    assert (a.compared, a.total) == (1 + 4, 8)
    a = greedy_agreement([tied, REF], [parted, [1, 2, 9, 4]])  # the other sequence is still checked
    assert not a.ok and "sequence 1 step 2" in a.detail
