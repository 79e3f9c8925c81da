"""Speculative rejection sampling as static-shape tensor code (no host syncs), for the fused round.

Every function works on many rows at once with per-row sampling parameters, and draws with uniforms it is
given (inverse CDF: one uniform per draw), so a captured graph is deterministic given its inputs and the
host keeps the randomness (each sequence's own generator, hence seeded requests stay reproducible).

- ``filter_probs``: the sampler's distribution (``sampler.filter_logits`` then softmax: temperature,
  min-p, top-k, top-p in vLLM V1's order) for rows with their own parameters; top-k and top-p need a sort
  of each row, paid only when asked for (``sort=True``).
- ``sample_rows``: one token per row by inverse CDF.
- ``accept_drafts``: the acceptance test of k drafts against the target, the residual sample at the first
  rejection, or the bonus token when every draft is accepted.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fp4moe.engine.request.sampler import SamplingParams


def needs_sort(params: Sequence[SamplingParams], vocab_size: int) -> bool:
    """Whether any sampled (temperature > 0) row asks for top-k or top-p (``filter_probs(sort=True)``)."""
    return any(not p.greedy and (0 < p.top_k < vocab_size or p.top_p < 1.0) for p in params)


def row_params(params: Sequence[SamplingParams]) -> tuple[list[float], list[int], list[float], list[float]]:
    """(temperature, top_k, top_p, min_p) per row; greedy rows (temperature 0) keep temperature 0 and get
    neutral filters (their draws are argmax, the filter's output for them is never used)."""
    rows = [(0.0, 0, 1.0, 0.0) if p.greedy else (p.temperature, p.top_k, p.top_p, p.min_p) for p in params]
    temperature, top_k, top_p, min_p = (list(x) for x in zip(*rows, strict=True)) if rows else ([],) * 4
    return temperature, top_k, top_p, min_p


def filter_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    sort: bool = True,
) -> torch.Tensor:
    """Probabilities [R, V] (fp32) from logits [R, V] with per-row temperature (0 = greedy: the row is
    filtered at temperature 1, its result is meant to be ignored), min-p (0 = off), top-k (0, -1 or >= V =
    off) and top-p (1 = off); the same entries as ``filter_logits(logits[r], params_r).softmax(-1)``.
    ``sort=False`` skips top-k and top-p (only valid when every row has them off)."""
    ninf = float("-inf")
    x = logits.float() / temperature.float().masked_fill(temperature <= 0, 1.0)[:, None]
    probs = x.softmax(-1)
    x = x.masked_fill(probs < min_p.float()[:, None] * probs.amax(-1, keepdim=True), ninf)  # min_p 0: none
    if sort:
        v = x.shape[-1]
        sx, order = torch.sort(x, dim=-1, descending=True)
        k = top_k.long()
        # top-k: drop what is below the k-th largest value (ties with it stay)
        kth = sx.gather(1, (k.clamp(1, v) - 1)[:, None])
        kth = kth.masked_fill(((k <= 0) | (k >= v))[:, None], ninf)
        sx = sx.masked_fill(sx < kth, ninf)  # the row stays sorted
        # top-p: drop a token when the mass before it already reaches top_p (the first one always stays)
        sp = sx.softmax(-1)
        drop = (sp.cumsum(-1) - sp) >= top_p.float()[:, None]
        drop[:, 0] = False
        drop &= (top_p < 1.0)[:, None]
        sx = sx.masked_fill(drop, ninf)
        x = torch.empty_like(x).scatter_(1, order, sx)
    return x.softmax(-1)


def sample_rows(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One index per row of non-negative ``weights`` [R, V] (not necessarily normalised, each row with
    some positive weight) by inverse CDF with uniforms ``u`` [R] in [0, 1) -> [R] int64; an index of zero
    weight is never chosen."""
    cdf = weights.float().cumsum(-1)
    target = (u.float() * cdf[:, -1]).unsqueeze(-1)
    index = torch.searchsorted(cdf, target, right=True).squeeze(-1)  # first index whose cdf passes target
    # u * total may round up to total: take the last index of positive weight then
    last = weights.shape[-1] - 1 - (weights > 0).flip(-1).int().argmax(-1)
    return torch.minimum(index, last)


def accept_drafts(
    p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, u_accept: torch.Tensor, u_final: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative rejection sampling of k drafts per row.

    ``p`` [B, k+1, V]: the target's distributions at the k+1 verified positions; ``q`` [B, k, V]: the draft
    distributions draft j was sampled from; ``drafts`` [B, k]; uniforms ``u_accept`` [B, k] and
    ``u_final`` [B]. Draft j is accepted when u_j * q_j(d_j) <= p_j(d_j) (and p_j(d_j) > 0), up to the first
    rejection: a = the number accepted. At row a < k the final token is drawn from max(0, p_a - q_a)
    normalised (p_a where that is all zero); with a = k it is the bonus token from p_k. The emitted tokens
    are d_1..d_a and the final one, distributed as sampling from p alone. Returns (a [B], final [B])."""
    b, k = drafts.shape
    d = drafts.long().unsqueeze(-1)
    pd = p[:, :k].gather(2, d).squeeze(-1)
    qd = q.gather(2, d).squeeze(-1)
    ok = (u_accept * qd <= pd) & (pd > 0)
    accepted = ok.long().cumprod(1).sum(1)
    rows = torch.arange(b, device=p.device)
    pa = p[rows, accepted]
    qa = q[rows, accepted.clamp(max=k - 1)] * (accepted < k).unsqueeze(-1)  # no draft past k: p_k itself
    residual = (pa - qa).clamp(min=0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, pa)
    return accepted, sample_rows(residual, u_final)
