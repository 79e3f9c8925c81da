"""The format search behind ``quantize --budget kl=X`` / ``--target-bytes N`` / ``--target-bpw B``: from the
measured sensitivity table (``quantize.sensitivity``), one format per decoder layer and part.

The predictor is first order: the KL of an assignment is taken as the sum of each part's KL measured with
only that part quantized (bf16: 0). ``--budget`` picks the fewest bytes whose predicted KL is within X;
the byte and bits-per-weight targets pick the least predicted KL within the size. Both are a
multiple-choice knapsack solved by dynamic programming on a grid of ``GRID`` steps of the predicted KL (each
part's KL above its least rounded up to the grid), with the bytes kept exact: the answer always meets the
target, and its bytes (``--budget``) or KL (byte targets) miss the optimum by at most one grid step a part.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from fp4moe.errors import UserError
from fp4moe.formats.checkpoint import parse_size
from fp4moe.quantize import parts as P

GRID = 8000
KINDS = ("kl", "bytes", "bpw")


class SearchError(UserError, ValueError):
    pass


@dataclass
class SearchTarget:
    """What the search must meet: ``kl`` (predicted mean KL, nats/token), ``bytes`` (checkpoint tensor
    bytes) or ``bpw`` (stored bits per weight over the searched parts)."""

    kind: str
    value: float

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"search target kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not math.isfinite(self.value) or self.value <= 0:
            raise ValueError(f"the {self.kind} target must be a positive number, got {self.value!r}")

    @classmethod
    def parse(cls, budget: str | None = None, target_bytes: str | None = None,
              target_bpw: float | None = None) -> SearchTarget | None:  # fmt: skip
        """From the CLI's ``--budget kl=X``, ``--target-bytes N`` (``12GB`` etc.), ``--target-bpw B``."""
        given = [x for x in (budget, target_bytes, target_bpw) if x is not None]
        if len(given) > 1:
            raise ValueError("give one of --budget, --target-bytes, --target-bpw")
        if budget is not None:
            key, _, value = str(budget).partition("=")
            if key.strip() != "kl" or not value:
                raise ValueError(
                    f"--budget {budget!r}: write it as kl=X, X the mean KL in nats (e.g. kl=0.01)"
                )
            try:
                number = float(value)
            except ValueError:
                raise ValueError(f"--budget {budget!r}: {value!r} is not a number") from None
            return cls("kl", number)
        if target_bytes is not None:
            return cls("bytes", float(parse_size(target_bytes)))
        if target_bpw is not None:
            return cls("bpw", float(target_bpw))
        return None

    def __str__(self) -> str:
        return {
            "kl": f"kl={self.value:g}",
            "bytes": f"{int(self.value)} bytes",
            "bpw": f"{self.value:g} bpw",
        }[self.kind]


@dataclass
class Assignment:
    """One format per (layer, part), with what the predictor says of it."""

    formats: dict[tuple[int, str], str]
    predicted_kl: float
    bytes: int  # all tensors of the checkpoint (the parts as chosen plus everything else)
    bits_per_weight: float  # over the searched parts
    measured_kl: float | None = None  # filled by the quantize pass (held-out calibration windows)
    target: SearchTarget | None = None
    notes: list[str] = field(default_factory=list)

    def layer_groups(self, layer: int) -> list[tuple[list[str], str]]:
        """(fused group, fp8 | nvfp4) of layer ``layer``'s quantized non-expert parts, as the writer takes them."""
        out = []
        for (i, part), fmt in sorted(self.formats.items()):
            if i == layer and part != "experts" and fmt != P.BF16:
                out += [(g, fmt) for g in P.groups(part)]
        return out

    def experts_gptq(self, layer: int) -> bool:
        return self.formats.get((layer, "experts")) == P.NVFP4_GPTQ

    def uses_fp8(self) -> bool:
        return P.FP8 in self.formats.values()

    def to_json(self) -> dict:
        return {
            "target": None if self.target is None else {"kind": self.target.kind, "value": self.target.value},
            "predicted_kl": self.predicted_kl,
            "measured_kl": self.measured_kl,
            "bytes": self.bytes,
            "bits_per_weight": self.bits_per_weight,
            "formats": [{"layer": i, "part": p, "format": f} for (i, p), f in sorted(self.formats.items())],
        }


def ceil_sig(x: float, digits: int = 4) -> float:
    """``x`` rounded up to ``digits`` significant digits (a feasible value to name in an error)."""
    if x <= 0:
        return x
    step = 10 ** (math.floor(math.log10(x)) - digits + 1)
    return math.ceil(x / step - 1e-9) * step


def _grid_dp(weights: list[list[float]], costs: list[list[float]], cap: float):
    """The table behind both searches: per group one choice, ``dp[k]`` the least total cost whose weights,
    each rounded up to ``cap / GRID``, sum to k steps; with the choices to backtrack."""
    unit = cap / GRID

    def grid_steps(w: float) -> int:
        if w <= 0:
            return 0
        return GRID + 1 if cap <= 0 else math.ceil(w / unit)  # cap 0: only weightless choices fit

    dp = np.zeros(GRID + 1)
    dp[1:] = np.inf
    back, steps = [], []
    for ws, cs in zip(weights, costs, strict=True):
        new = np.full(GRID + 1, np.inf)
        arg = np.full(GRID + 1, -1, dtype=np.int64)
        step = [grid_steps(w) for w in ws]
        for c, (k, cost) in enumerate(zip(step, cs, strict=True)):
            if k > GRID:
                continue
            shifted = np.full(GRID + 1, np.inf)
            shifted[k:] = dp[: GRID + 1 - k] + cost
            better = shifted < new
            new[better], arg[better] = shifted[better], c
        dp = new
        back.append(arg)
        steps.append(step)
    return dp, back, steps


def _backtrack(back: list, steps: list, k: int) -> list[int]:
    choice = []
    for arg, step in zip(reversed(back), reversed(steps), strict=True):
        c = int(arg[k])
        choice.append(c)
        k -= step[c]
    return choice[::-1]


def _knapsack(weights: list[list[float]], costs: list[list[float]], cap: float) -> list[int] | None:
    """Per group one choice, least total cost with total weight <= cap (weights rounded up to cap/GRID);
    None if no choice set fits."""
    dp, back, steps = _grid_dp(weights, costs, cap)
    if not np.isfinite(dp).any():
        return None
    return _backtrack(back, steps, int(np.argmin(dp)))


def _least_weight_within(weights: list[list[float]], costs: list[list[float]], limit: float) -> list[int]:
    """Per group one choice, (near) least total weight whose exact total cost is <= ``limit``: the grid runs
    over the weights (each rounded up to 1/GRID of their largest possible total) and the cost is kept
    exact, so the limit holds exactly and the weight is within a grid step a group of the optimum. The
    least-cost choice of every group must meet the limit."""
    # a step of span / (GRID - groups): every rounded total, the largest included, stays on the grid
    span = sum(max(ws) for ws in weights) or 1.0
    dp, back, steps = _grid_dp(weights, costs, span * GRID / (GRID - len(weights)))
    k = int(np.flatnonzero(dp <= limit)[0])
    return _backtrack(back, steps, k)


def search(table, target: SearchTarget) -> Assignment:
    """The assignment meeting ``target`` on ``table`` (a ``sensitivity.SensitivityTable``), or a SearchError
    naming the nearest feasible target."""
    rows = table.parts
    options = [[f for f in P.WRITABLE[r.part] if f in r.kl] for r in rows]
    kls = [[r.kl[f] for f in opts] for r, opts in zip(rows, options, strict=True)]
    sizes = [[r.bytes[f] for f in opts] for r, opts in zip(rows, options, strict=True)]
    params = sum(r.params for r in rows)
    least_kl = sum(min(k) for k in kls)
    least_bytes = table.fixed_bytes + sum(min(s) for s in sizes)
    parts_least = sum(min(s) for s in sizes)
    if target.kind == "kl":
        if target.value < least_kl:
            raise SearchError(
                f"--budget kl={target.value:g} is below the least predicted KL a checkpoint this tool writes "
                f"reaches ({least_kl:.4g}: routed experts NVFP4, everything else bf16); ask for kl>={ceil_sig(least_kl):g}"
            )
        max_kl = max(max(k) for k in kls) or 1.0
        # fewest bytes; among equal sizes the smaller KL (the tie-break adds well under one byte in total)
        costs = [[s + 0.5 * k / (max_kl * len(rows)) for s, k in zip(ss, ks, strict=True)]
                 for ss, ks in zip(sizes, kls, strict=True)]  # fmt: skip
        # each part's KL above its least, against the budget above the floor: the floor itself weighs 0
        # on the grid, so an assignment always exists
        extra = [[k - min(ks) for k in ks] for ks in kls]
        choice = _knapsack(extra, costs, target.value - least_kl)
    else:
        cap = target.value - table.fixed_bytes if target.kind == "bytes" else target.value * params / 8
        if cap < parts_least:
            if target.kind == "bytes":
                raise SearchError(
                    f"--target-bytes {int(target.value)} is under the smallest checkpoint the search can write "
                    f"(all NVFP4: {least_bytes} bytes, {least_bytes / (1 << 30):.3f} GB as --target-bytes counts them, "
                    f"1 GB = 2^30 bytes); ask for at least {least_bytes}"
                )
            least_bpw = 8 * parts_least / params
            raise SearchError(
                f"--target-bpw {target.value:g} is under the fewest bits per weight the search can write "
                f"(all NVFP4: {least_bpw:.3f}); ask for at least {ceil_sig(least_bpw):g}"
            )
        # the byte limit exact (a build at exactly a hand mix's size can be that mix), the KL on the grid
        extra = [[k - min(ks) for k in ks] for ks in kls]
        room = [[s - min(ss) for s in ss] for ss in sizes]
        choice = _least_weight_within(extra, room, cap - parts_least)
    assert choice is not None  # the floor of each constraint weighs 0 and fits
    formats = {(r.layer, r.part): opts[c] for r, opts, c in zip(rows, options, choice, strict=True)}
    chosen_bytes = sum(ss[c] for ss, c in zip(sizes, choice, strict=True))
    return Assignment(
        formats=formats,
        predicted_kl=float(sum(ks[c] for ks, c in zip(kls, choice, strict=True))),
        bytes=table.fixed_bytes + chosen_bytes,
        bits_per_weight=8 * chosen_bytes / params,
        target=target,
    )
