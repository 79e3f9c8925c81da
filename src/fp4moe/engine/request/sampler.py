"""Sampling parameters and the sampler: penalties, temperature, top-k, top-p, min-p, seeded draws, logprobs.

Semantics follow vLLM: the repetition penalty applies to prompt and output tokens (divide positive logits,
multiply negative ones); presence and frequency penalties to output tokens only; a temperature below 1e-5
(vLLM's ``_SAMPLING_EPS``) is greedy. Extreme values cannot make a draw fail: logits that overflow (a
repetition penalty of 1e-308) are clamped to the largest finite value, NaN ones dropped.

Two samplers with one meaning: ``sample`` takes one sequence's logits row (the reference, plain torch,
``torch.multinomial``), ``sample_batch`` a whole step's rows where they are (the GPU's logits stay on the
GPU): penalties, temperature, min-p, top-k and top-p per row in a few batched tensor operations, one
draw for every row by the exponential race (vLLM's: ``argmax(p / q)`` with ``q ~ Exp(1)``, which picks
token i with probability p_i), and one read-back of the chosen ids. A seeded row's ``q`` is drawn on the
logits' device from a seed its own generator gives, so its tokens depend on its seed alone (on one kind of
device), not on the batch. Greedy
rows are exact against ``sample``; sampled rows are equal in distribution (tests/engine/test_sampler.py).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from fp4moe.engine.device.transfer import to_device

SAMPLING_EPS = 1e-5  # a temperature below this is greedy (vLLM's rule: dividing by it would overflow)


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = (
        None  # number of top logprobs to return per token (the sampled one is always given)
    )
    n: int = 1
    # top logprobs to return per prompt token, with each prompt token's own (vLLM's; None: no prompt logprobs)
    prompt_logprobs: int | None = None

    def __post_init__(self):
        if self.stop is None:
            self.stop = []
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if any(not isinstance(x, str) or not x for x in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop!r}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if self.temperature < SAMPLING_EPS:
            self.temperature = 0.0
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off), 0 (off) or positive, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be non-negative, got {self.logprobs}")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Any repetition, presence or frequency penalty (they depend on the history, sampled on the host)."""
        return self.repetition_penalty != 1.0 or bool(self.presence_penalty) or bool(self.frequency_penalty)


def apply_penalties(
    logits: torch.Tensor, prompt_ids: list[int], output_ids: list[int], p: SamplingParams
) -> torch.Tensor:
    """logits [V] (fp32) with repetition/presence/frequency penalties applied."""
    if p.repetition_penalty != 1.0 and (prompt_ids or output_ids):
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long, device=logits.device)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if output_ids and (p.presence_penalty or p.frequency_penalty):
        counts = torch.bincount(
            torch.tensor(output_ids, device=logits.device), minlength=logits.shape[-1]
        ).float()
        logits = logits - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
    return logits


def filter_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature-scaled logits [V] with min-p, then top-k, then top-p applied (vLLM V1's order; masked
    entries at -inf)."""
    logits = logits / p.temperature
    if p.min_p > 0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass of the tokens before it already reaches top_p (keep at least one)
        drop = (probs.cumsum(-1) - probs) >= p.top_p
        drop[0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


@dataclass
class SampleResult:
    token_id: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None


def sample(
    logits: torch.Tensor,
    prompt_ids: list[int],
    output_ids: list[int],
    p: SamplingParams,
    generator: torch.Generator | None,
) -> SampleResult:
    """One token from raw logits [V] of one sequence."""
    raw = logits.float()
    processed = _finite(apply_penalties(raw.clone(), prompt_ids, output_ids, p))
    if p.greedy:
        token = int(torch.argmax(processed))
    else:
        probs = _finite(filter_logits(processed, p)).softmax(-1)
        token = int(torch.multinomial(probs, 1, generator=generator))
    return sample_result(token, raw, p)


def _finite(logits: torch.Tensor) -> torch.Tensor:
    """+inf -> the largest finite value (still the most likely), NaN -> -inf (never drawn)."""
    return torch.nan_to_num(logits, nan=float("-inf"), posinf=torch.finfo(logits.dtype).max)


def sample_result(token: int, raw_logits: torch.Tensor, p: SamplingParams) -> SampleResult:
    """The chosen token with its raw-model logprob and the top ``p.logprobs`` (when asked for)."""
    if p.logprobs is None:
        return SampleResult(token)
    logprobs = raw_logits.float().log_softmax(-1)
    top = torch.topk(logprobs, p.logprobs) if p.logprobs else None
    top_dict = (
        {int(i): float(v) for v, i in zip(top.values, top.indices, strict=True)} if top is not None else {}
    )
    return SampleResult(token, float(logprobs[token]), top_dict)


@dataclass
class SampleRow:
    """What the batched sampler needs of one sequence."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    generator: torch.Generator | None = None


def sample_batch(logits: torch.Tensor, rows: Sequence[SampleRow]) -> list[SampleResult]:
    """One token for each row of ``logits`` [B, V] (on any device), ``sample``'s semantics, batched."""
    raw = logits.float()
    tokens = sample_tokens(raw, rows)
    ids = tokens.tolist()
    params, device = [r.params for r in rows], raw.device
    out = [SampleResult(t) for t in ids]
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not want:
        return out
    w = torch.tensor(want, device=device)
    logprobs = raw[w].log_softmax(-1)
    chosen = logprobs.gather(1, tokens[w][:, None])[:, 0].tolist()
    k = max(params[i].logprobs for i in want)
    top = torch.topk(logprobs, k) if k else None
    values, indices = (top.values.tolist(), top.indices.tolist()) if top is not None else ([], [])
    for j, i in enumerate(want):
        n = params[i].logprobs
        top_dict = dict(zip(indices[j][:n], values[j][:n], strict=True)) if n else {}
        out[i] = SampleResult(ids[i], chosen[j], top_dict)
    return out


def sample_tokens(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """The ids ``sample_batch`` draws, left on the logits' device [B] (no read-back, and no copy that waits
    for the GPU: the engine's async scheduling samples a step while the GPU may still run the one before).
    Rows with penalties read their history (``output_ids``) now, so it must be complete."""
    raw = logits.float()
    device = raw.device
    params = [r.params for r in rows]
    penalized = [i for i, p in enumerate(params) if p.penalized]
    x = _finite(_penalize(raw.clone(), rows, penalized) if penalized else raw)
    tokens = torch.empty(len(rows), dtype=torch.long, device=device)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    drawn = [i for i, p in enumerate(params) if not p.greedy]
    if len(greedy) == len(rows):
        return x.argmax(-1)
    if greedy:
        g = to_device(greedy, torch.long, device)
        tokens[g] = x[g].argmax(-1)
    d = to_device(drawn, torch.long, device)
    temperature = to_device([params[i].temperature for i in drawn], torch.float64, device).float()
    probs = _finite(_filter_rows(x[d] / temperature[:, None], [params[i] for i in drawn])).softmax(-1)
    q = torch.empty_like(probs).exponential_()
    seeded = [(j, rows[i].generator) for j, i in enumerate(drawn) if rows[i].generator is not None]
    if seeded:  # each its own noise: a seed from its generator, the row drawn where the logits are
        noise = _noise_generator(device)
        for j, gen in seeded:
            noise.manual_seed(int(torch.randint(1 << 62, (), generator=gen)))
            q[j].exponential_(generator=noise)
    tokens[d] = (probs / q).argmax(-1)
    return tokens


# per thread: a server's engine thread and an offline LLM never share one
_noise_generators = threading.local()


def _noise_generator(device: torch.device) -> torch.Generator:
    """One generator per device that seeded rows re-seed in turn (``sample_tokens``): a row's noise is a
    function of the seed its own host generator draws, so its tokens depend on its seed alone, not on the
    batch; and it is drawn on the logits' device, one launch a row. (Drawn on the host and uploaded, as
    before, a full-size row -- 248,320 exponentials and a 1 MB copy -- cost ~10 ms of host time: 64 seeded
    streams spent 0.6 s a step sampling, the server's warm-up 6 s.)"""
    by_device = _noise_generators.__dict__.setdefault("by_device", {})
    gen = by_device.get(device)
    if gen is None:
        gen = by_device[device] = torch.Generator(device=device)
    return gen


def _penalize(x: torch.Tensor, rows: Sequence[SampleRow], which: list[int]) -> torch.Tensor:
    """``apply_penalties`` on the rows ``which`` of x [B, V] (in place): the seen and counted ids of every
    such row go to the device as two index tensors."""
    device = x.device
    seen_rows, seen_ids, out_rows, out_ids = [], [], [], []
    rep, freq, pres = [1.0] * len(rows), [0.0] * len(rows), [0.0] * len(rows)
    for i in which:
        r, p = rows[i], rows[i].params
        if p.repetition_penalty != 1.0:
            seen = set(r.prompt_ids) | set(r.output_ids)
            seen_rows += [i] * len(seen)
            seen_ids += seen
            rep[i] = p.repetition_penalty
        if r.output_ids and (p.presence_penalty or p.frequency_penalty):
            out_rows += [i] * len(r.output_ids)
            out_ids += r.output_ids
            freq[i], pres[i] = p.frequency_penalty, p.presence_penalty
    # fp32 as the reference's scalars become (1e300 -> inf, 1e-308 -> 0), without the overflow check of
    # an element assignment
    rep, freq, pres = (torch.tensor(v, dtype=torch.float64).float() for v in (rep, freq, pres))
    if seen_ids:
        mask = torch.zeros_like(x, dtype=torch.bool)
        mask[torch.tensor(seen_rows, device=device), torch.tensor(seen_ids, device=device)] = True
        r = rep.to(device)[:, None]
        x = torch.where(mask, torch.where(x > 0, x / r, x * r), x)
    if out_ids:
        counts = torch.zeros_like(x)
        index = (torch.tensor(out_rows, device=device), torch.tensor(out_ids, device=device))
        counts.index_put_(index, torch.ones(len(out_ids), device=device), accumulate=True)
        x = x - freq.to(device)[:, None] * counts - pres.to(device)[:, None] * (counts > 0).float()
    return x


def _filter_rows(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """``filter_logits`` per row of temperature-scaled x [S, V]: min-p, then top-k, then top-p; each only on
    the rows that ask for it."""
    device, vocab, inf = x.device, x.shape[-1], float("-inf")
    min_p = [p.min_p for p in params]
    if any(min_p):
        probs = x.softmax(-1)
        floor = to_device(min_p, torch.float32, device)[:, None] * probs.amax(-1, keepdim=True)
        x = x.masked_fill(probs < floor, inf)  # a row with min_p 0 drops nothing: no prob is below 0
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(top_k):
        k = to_device(top_k, torch.long, device)
        values = torch.topk(x, max(top_k)).values
        kth = values.gather(1, (k - 1).clamp(min=0)[:, None])
        x = x.masked_fill((x < kth) & (k > 0)[:, None], inf)
    top_p = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if top_p:
        rows = to_device(top_p, torch.long, device)
        sorted_x, order = torch.sort(x[rows], descending=True)
        probs = sorted_x.softmax(-1)
        p = to_device([params[i].top_p for i in top_p], torch.float32, device)[:, None]
        drop = (probs.cumsum(-1) - probs) >= p
        drop[:, 0] = False
        x[rows] = x[rows].masked_fill(torch.zeros_like(drop).scatter(1, order, drop), inf)
    return x
