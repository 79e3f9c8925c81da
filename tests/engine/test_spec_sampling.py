"""The fused round's sampling as tensor code (engine.spec.spec_sampling): the per-row filter keeps what the
sampler keeps, inverse-CDF draws never pick a dropped token, and the vectorised acceptance step emits the
target's distribution (checked on many synthetic rows at once)."""

import itertools

import pytest
import torch
from goodness_of_fit import assert_follows

from fp4moe.engine.request.sampler import SamplingParams, filter_logits
from fp4moe.engine.spec.spec_sampling import accept_drafts, filter_probs, needs_sort, row_params, sample_rows

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
    """300,000 rows at once, k = 2, fixed synthetic distributions over 6 tokens (target p_0, p_1, p_2 and
    drafts q_0, q_1): the first emitted token ~ p_0; the second, where the first draft was accepted, ~ p_1;
    the bonus token after two acceptances ~ p_2 -- each a chi-square test that a 0.02 total-variation bias
    fails with probability >= 0.99 (tests/engine/goodness_of_fit.py; it checks the draws are enough); and
    the acceptance rates are sum(min(p_j, q_j)) (within 6 standard errors)."""
    n, k = 300_000, 2
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
    assert_follows(first, p[0], "first token")
    assert_follows(second, p[1], "second token")
    assert_follows(bonus, p[2], "bonus token")
    overlap = torch.minimum(p[:k], q).sum(-1)
    for rate, want in ((accepted > 0, overlap[0]), (accepted == k, overlap[0] * overlap[1])):
        assert abs(rate.float().mean() - want) < 6 * (want * (1 - want) / n) ** 0.5


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


class _ChainRunner:
    """A stand-in for CudaModelRunner under FusedSpecRound: the target's next-token logits after token c
    are log P[c], the MTP head's are log Q[c] (hidden states are one-hot tokens, target half then head
    half, through one shared lm_head), whatever the position; caches are no-ops. The Gated DeltaNet
    history holds each verified row's index, so the rollback copy can be checked."""

    def __init__(self, p: torch.Tensor, q: torch.Tensor, k: int, max_num_seqs: int):
        v = p.shape[0]
        self.spec_tokens, self.max_num_seqs, self.scratch, self.device = k, max_num_seqs, max_num_seqs, "cpu"
        self.args = type("Args", (), {"vocab_size": v})()
        weight = torch.cat([p.log(), q.log()])  # [2V, V]
        head = type(
            "MTP",
            (),  # the MTP head's draft logits: the whole vocabulary through the shared lm_head
            {
                "logits": staticmethod(lambda model, h: model.lm_head(h)),
                "greedy": staticmethod(lambda model, h: model.lm_head(h).argmax(-1)),
            },
        )()
        self.model = type("Model", (), {"lm_head": staticmethod(lambda h: h @ weight), "mtp": head})()
        self.kv = type("KV", (), {"reserve": lambda *_: None, "advance": lambda *_: None})()
        self.states = type("States", (), {"rec": torch.zeros(1, max_num_seqs + 1)})()
        self.history = torch.zeros(1, max_num_seqs * (k + 1))
        self.v = v

    def graph_bucket(self, b):
        return None

    def forward_rows(self, ids, pos, slots, rope, tokens_per_seq):
        rows = torch.arange(len(ids), dtype=torch.float32)
        self.history[0, : len(ids)] = rows  # the states after each row; the last row's in the slot
        self.states.rec[0, slots[::tokens_per_seq].long()] = rows[tokens_per_seq - 1 :: tokens_per_seq]
        x = torch.nn.functional.one_hot(ids, 2 * self.v).float()
        return x, x

    def mtp_rows(self, ids, hidden, pos, slots, rope, keep=None):
        out = torch.nn.functional.one_hot(ids + self.v, 2 * self.v).float()
        return out if keep is None else out[keep]


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=1.0),
        dict(temperature=0.7, top_k=4, top_p=0.9),
        dict(temperature=1.3, min_p=0.15),
    ],
    ids=["plain", "top-k-top-p", "min-p"],
)
def test_fused_round_emits_the_target_chain(params):
    """FusedSpecRound.forward's sampling (filter per row, acceptance, final token, next drafts drawn and
    their distributions kept by slot for the next round) on 50,000 sequences at once, three rounds, over a
    Markov chain target P and a different draft head Q on 6 tokens. Sequences take turns: ``params``, a
    second setting (temperature 2, top-p 0.8 or none) and, every tenth, greedy. The first three emitted
    tokens of each sampled group are distributed as sampling its filtered chain alone (pairs and the third
    token's marginal, TV < 0.03 with noise ~0.01), greedy sequences follow the argmax chain, and the
    rolled-back state is the one after the last accepted row."""
    from fp4moe.engine.request.sampler import SamplingParams
    from fp4moe.engine.spec.cuda_spec import SAMPLED, SORTED, FusedSpecRound

    v, k, n = 6, 2, 50_000
    g = torch.Generator().manual_seed(4)
    target = (torch.randn(v, v, generator=g) * 1.5).softmax(-1)
    draft = (0.5 * target.log() + torch.randn(v, v, generator=g)).softmax(-1)  # related, not equal
    runner = _ChainRunner(target, draft, k, n)
    fused = FusedSpecRound(runner, k)
    modes = []
    forward = fused.forward
    fused.forward = lambda b, mode: modes.append(mode) or forward(b, mode)
    settings = [
        SamplingParams(temperature=0.0),
        SamplingParams(**params),
        SamplingParams(temperature=2.0, top_p=0.8 if "top_k" in params else 1.0),
    ]
    group = torch.where(torch.arange(n) % 10 == 0, 0, 1 + torch.arange(n) % 2)
    seq_params = [settings[i] for i in group.tolist()]

    def filtered(dist, sp):  # the sampler's distribution after each token c, as a [V, V] transition matrix
        return torch.stack([filter_logits(dist[c].log().clone(), sp).softmax(-1) for c in range(v)])

    # the first drafts, as the module path draws them: d_1 ~ Q[x_p], d_2 ~ Q[d_1], filtered (argmax: greedy)
    pending = torch.zeros(n, dtype=torch.long)
    d1, d2 = torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long)
    d1[group == 0] = draft[0].argmax()
    d2[group == 0] = draft[d1[group == 0]].argmax(-1)
    for i in (1, 2):
        qf, rows = filtered(draft, settings[i]), group == i
        d1[rows] = torch.multinomial(qf[pending[rows]], 1, generator=g).squeeze(1)
        d2[rows] = torch.multinomial(qf[d1[rows]], 1, generator=g).squeeze(1)
    slots = list(range(n))
    sampled = (group > 0).nonzero().squeeze(1)
    logits = draft.log()[torch.stack([pending, d1], 1)[sampled]]
    fused.set_draft_probs(sampled.tolist(), logits, [seq_params[i] for i in sampled.tolist()])
    drafts, emitted = torch.stack([d1, d2], 1), [[] for _ in range(n)]
    for _ in range(3):
        uniforms = torch.rand(n, 2 * k + 1, generator=g)
        tokens = torch.cat([pending[:, None], drafts], 1).tolist()
        accepted, ys, drafts = fused(slots, [0] * n, tokens, [0] * n, sampling=(seq_params, uniforms))
        assert torch.equal(runner.states.rec[0, :n], (torch.arange(n) * (k + 1) + accepted).float())
        for i, (a, y) in enumerate(zip(accepted.tolist(), ys.tolist(), strict=True)):
            emitted[i] += y[: a + 1]
        pending = torch.tensor([e[-1] for e in emitted])
    assert modes == [SORTED if "top_k" in params else SAMPLED] * 3
    first3 = torch.tensor([e[:3] for e in emitted])
    chain = [int(target[0].argmax())]
    while len(chain) < 3:
        chain.append(int(target[chain[-1]].argmax()))
    assert (first3[group == 0] == torch.tensor(chain)).all()
    for i in (1, 2):
        pf, got = filtered(target, settings[i]), first3[group == i]
        pairs = torch.bincount(got[:, 0] * v + got[:, 1], minlength=v * v).float() / len(got)
        assert 0.5 * (pairs - (pf[0][:, None] * pf).reshape(-1)).abs().sum() < 0.03
        third = torch.bincount(got[:, 2], minlength=v).float() / len(got)
        assert 0.5 * (third - pf[0] @ pf @ pf).abs().sum() < 0.03
