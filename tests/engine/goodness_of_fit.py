"""Samplers checked by distribution: Pearson's chi-square test of drawn tokens against the exact distribution
they must follow, at a sample size whose power is stated.

Power. Against any sampler whose distribution q is ``TV`` = 0.02 away (total variation) from the target p, the
statistic is non-central chi-square with non-centrality n * sum((q - p)^2 / p) >= n * (sum |q - p|)^2 = 4 n TV^2
(Cauchy-Schwarz, sum p = 1): the least detectable bias is the one proportional to p. Tokens whose expected
count is below 5 are pooled into one bin (the chi-square approximation needs it); a bias hidden inside that
bin is at most its mass, so the bound uses TV minus the pooled mass. ``needed_draws`` gives the n at which
every such bias fails with probability >= ``POWER`` at significance ``ALPHA``; ``assert_follows`` refuses to
run with fewer. With fixed seeds the tests are deterministic; ALPHA is the chance that another seed would
fail a correct sampler.
"""

from __future__ import annotations

import torch
from scipy.stats import chi2, ncx2

ALPHA = 1e-5  # the false-alarm rate per check
TV = 0.02  # the bias every check must catch ...
POWER = 0.99  # ... with at least this probability
MIN_EXPECTED = 5.0


def _bins(probs: torch.Tensor, n: int) -> tuple[torch.Tensor, float]:
    """Tokens of their own bin (expected count >= 5) as a mask over the support, and the pooled mass."""
    support = probs > 0
    own = support & (probs * n >= MIN_EXPECTED)
    return own, float(probs[support & ~own].sum())


def power(n: int, probs: torch.Tensor, tv: float = TV, alpha: float = ALPHA) -> float:
    """The smallest probability that ``assert_follows`` fails a sampler ``tv`` away from ``probs`` with n draws."""
    own, pooled = _bins(probs.double(), n)
    df = int(own.sum()) + (pooled > 0) - 1
    if df < 1:
        return 1.0  # one possible token: any other draw fails outright
    visible = max(tv - pooled, 0.0)
    return float(ncx2.sf(chi2.isf(alpha, df), df, 4 * n * visible**2))


def needed_draws(probs: torch.Tensor, tv: float = TV, alpha: float = ALPHA, power_: float = POWER) -> int:
    n = 1000
    while power(n, probs, tv, alpha) < power_:
        n = int(n * 1.1)
    return n


def p_value(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square p-value of ``tokens`` (ids) against ``probs`` [V]; 0 if any token is outside
    the support."""
    probs = probs.double()
    n = len(tokens)
    counts = torch.bincount(tokens.flatten().long(), minlength=len(probs)).double()
    if counts[probs == 0].sum() > 0:
        return 0.0
    own, pooled = _bins(probs, n)
    observed = torch.cat([counts[own], counts[(probs > 0) & ~own].sum().reshape(1)])
    expected = torch.cat([probs[own] * n, torch.tensor([pooled * n], dtype=torch.float64)])
    keep = expected > 0
    observed, expected = observed[keep], expected[keep]
    if len(expected) < 2:
        return 1.0
    stat = float(((observed - expected) ** 2 / expected).sum())
    return float(chi2.sf(stat, len(expected) - 1))


def assert_follows(tokens: torch.Tensor, probs: torch.Tensor, what: object = "") -> None:
    """``tokens`` are draws from ``probs`` (chi-square at ALPHA), with enough of them that a sampler TV = 0.02
    off would have failed with probability >= POWER."""
    n = len(tokens)
    assert power(n, probs) >= POWER, (
        f"{n} draws detect a {TV} TV bias with power {power(n, probs):.3f}: {what}"
    )
    p = p_value(tokens, probs)
    assert p >= ALPHA, (
        f"chi-square p = {p:.2e} < {ALPHA}: {what}; frequencies {torch.bincount(tokens.long(), minlength=len(probs)).double() / n}, target {probs}"
    )
