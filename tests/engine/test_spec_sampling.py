"""The fused round's sampling as tensor code (engine.spec_sampling): the per-row filter keeps what the
sampler keeps, inverse-CDF draws never pick a dropped token, and the vectorised acceptance step emits the
target's distribution (checked on many synthetic rows at once)."""

import itertools

import pytest
import torch

from fp4moe.engine.sampler import SamplingParams, filter_logits
from fp4moe.engine.spec_sampling import accept_drafts, filter_probs, needs_sort, row_params, sample_rows

V = 64


def _grid() -> list[SamplingParams]:
    temperatures, top_ks = (0.3, 1.0, 1.7), (0, -1, 1, 5, V, V + 3)
    top_ps, min_ps = (1.0, 0.9, 0.3, 0.02), (0.0, 0.05, 0.3, 1.0)
    return [
        SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)
        for t, k, p, m in itertools.product(temperatures, top_ks, top_ps, min_ps)
    ]


def _filtered(logits: torch.Tensor, params: list[SamplingParams], sort: bool) -> torch.Tensor:
    t, k, p, m = row_params(params)
    return filter_probs(logits, torch.tensor(t), torch.tensor(k), torch.tensor(p), torch.tensor(m), sort)


def _check_rows(logits: torch.Tensor, params: list[SamplingParams], got: torch.Tensor) -> None:
    for r, sp in enumerate(params):
        want = filter_logits(logits[r].clone(), sp).softmax(-1)
        assert torch.equal(got[r] > 0, want > 0), (r, sp)  # the same tokens kept
        torch.testing.assert_close(got[r], want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("scale", [1.0, 4.0])
def test_filter_probs_keeps_what_the_sampler_keeps(scale):
    params = _grid()
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(len(params), V, generator=g) * scale
    logits[::7, :3] = float("-inf")  # masked vocabulary entries
    assert needs_sort(params, V)
    _check_rows(logits, params, _filtered(logits, params, sort=True))
    # temperature and min-p alone need no sort
    plain = [sp for sp in params if sp.top_p == 1.0 and not 0 < sp.top_k < V]
    assert plain and not needs_sort(plain, V)
    _check_rows(logits[: len(plain)], plain, _filtered(logits[: len(plain)], plain, sort=False))


def test_filter_probs_with_tied_logits():
    params = [SamplingParams(temperature=1.0, top_k=k, min_p=m) for k in (1, 2, 3, 7) for m in (0.0, 0.5)]
    g = torch.Generator().manual_seed(1)
    logits = torch.randint(0, 4, (len(params), V), generator=g).float()  # many ties at the top-k edge
    _check_rows(logits, params, _filtered(logits, params, sort=True))


def test_greedy_rows_need_no_sort_and_get_neutral_filters():
    params = [SamplingParams(temperature=0.0, top_k=3, top_p=0.5, min_p=0.2), SamplingParams(temperature=0.7)]
    assert not needs_sort(params, V)
    assert row_params(params) == ([0.0, 0.7], [0, 0], [1.0, 1.0], [0.0, 0.0])
    assert needs_sort([SamplingParams(top_p=0.9)], V) and not needs_sort([SamplingParams(top_k=V)], V)


def test_sample_rows_follows_the_weights_and_never_picks_a_zero():
    w = torch.tensor([[0.0, 2.0, 0.0, 1.0, 1.0, 0.0]]).expand(50_000, -1)
    g = torch.Generator().manual_seed(2)
    got = sample_rows(w, torch.rand(50_000, generator=g))
    freq = torch.bincount(got, minlength=6).float() / 50_000
    assert (freq[w[0] == 0] == 0).all()
    assert (freq - w[0] / w[0].sum()).abs().max() < 0.01
    edges = torch.tensor([0.0, 0.5 - 2**-24, 0.5, 1 - 2**-24])  # the top uniform must not fall off the end
    assert sample_rows(w[:4], edges).tolist() == [1, 1, 3, 4]


def _rows(dist: torch.Tensor, n: int) -> torch.Tensor:
    return dist.expand(n, *dist.shape).clone()


def test_acceptance_step_emits_the_target_distribution():
    """20,000 rows at once, k = 2, fixed synthetic distributions over 6 tokens (target p_0, p_1, p_2 and
    drafts q_0, q_1): the first emitted token ~ p_0; the second, where the first draft was accepted, ~ p_1;
    the bonus token after two acceptances ~ p_2; acceptance rates are sum(min(p_j, q_j)) (TV < 0.02 with
    sampling noise ~0.006)."""
    n, k = 20_000, 2
    g = torch.Generator().manual_seed(3)
    p = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 1.5], [0.0, 0.0, 3.0, 1.0, -9.0, 0.5], [1.0] * 6])
    p = p.softmax(-1)
    q = torch.tensor([[0.0, 2.0, 0.5, 1.0, 0.0, -2.0], [0.5, -1.0, 1.0, 2.0, 1.0, 0.0]]).softmax(-1)
    drafts = torch.stack([torch.multinomial(q[j], n, replacement=True, generator=g) for j in range(k)], 1)
    accepted, final = accept_drafts(
        _rows(p, n), _rows(q, n), drafts, torch.rand(n, k, generator=g), torch.rand(n, generator=g)
    )
    first = torch.where(accepted > 0, drafts[:, 0], final)
    on = accepted > 0  # the second emitted token: the accepted second draft or the final token
    second = torch.where(accepted[on] > 1, drafts[on, 1], final[on])
    bonus = final[accepted == k]

    def tv(tokens, dist):
        return 0.5 * (torch.bincount(tokens, minlength=6).float() / len(tokens) - dist).abs().sum()

    assert tv(first, p[0]) < 0.02
    assert tv(second, p[1]) < 0.02
    assert len(bonus) > 1000 and tv(bonus, p[2]) < 0.03
    overlap = torch.minimum(p[:k], q).sum(-1)
    assert abs((accepted > 0).float().mean() - overlap[0]) < 0.02
    assert abs((accepted == k).float().mean() - overlap[0] * overlap[1]) < 0.02


def test_acceptance_step_with_degenerate_distributions_is_greedy():
    """One-hot target and drafts (temperature > 0 with top-k 1): a draft equal to the target's choice is
    always accepted, any other always rejected and corrected to the target's choice, whatever the uniforms
    (zero included)."""
    n, k, v = 6, 2, 5
    target = torch.tensor([[1, 3, 0], [1, 3, 0], [1, 3, 0], [2, 2, 2], [4, 0, 1], [0, 0, 0]])
    drafts = torch.tensor([[1, 3], [1, 4], [0, 3], [2, 2], [4, 1], [3, 3]])
    p = torch.nn.functional.one_hot(target, v).float()
    q = torch.nn.functional.one_hot(drafts, v).float()
    for u in (torch.zeros(n, k), torch.full((n, k), 1 - 2**-24)):
        accepted, final = accept_drafts(p, q, drafts, u, u[:, 0])
        assert accepted.tolist() == [2, 1, 0, 2, 1, 0]
        assert final.tolist() == [0, 3, 1, 2, 0, 0]
