"""Comparing two engines' greedy outputs (the GPU path against the CPU reference).

Greedy decoding in bf16 may legitimately part ways where the reference's two best tokens are nearly tied:
any change of summation order can flip such an argmax. ``greedy_agreement`` walks each sequence until
the first differing token and accepts it only at a near tie (reference margin between its top two
logprobs below ``tie``); where tokens agree, the chosen token's logprobs must be within ``tol``. One level
down, the same holds for the router: where the reference's k-th and (k+1)-th router logits are nearly tied,
a last-bit difference may pick another expert (``router_margins``).

Measured on the H200 (tiny random model, bf16 compute): 0.047 nats (bf16 weights, bf16 KV), 0.077 (fp8 KV),
0.109 (NVFP4 experts, whose CPU path rounds each dequantized weight to bf16 and the kernel does not) -- bf16
rounding of hidden states and logits in a different summation order; the random model's logits are flat,
so near ties are common. An indexing or scale bug moves logprobs by whole nats."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class Agreement:
    ok: bool
    identical: bool
    near_tie_splits: int
    max_logprob_diff: float
    detail: str = ""
    router_tie_splits: int = 0
    compared: int = 0  # tokens found equal before any excused split (what the comparison really checked)
    total: int = 0  # tokens in the reference
    checkable: int = 0  # tokens before each sequence's first excusable step (near tie or router near tie)

    def __str__(self) -> str:
        return (
            f"{self.compared} of {self.total} tokens compared ({self.checkable} before any excusable step), "
            f"{self.near_tie_splits} near-tie split(s), "
            f"{self.router_tie_splits} router near-tie split(s), chosen-token logprobs within "
            f"{self.max_logprob_diff:.4f}" + (f"; {self.detail}" if self.detail else "")
        )


def _tokens_and_logprobs(out) -> tuple[list[int], list | None]:
    """A RequestOutput's first completion (token ids and per-step logprobs), or a plain list of ids."""
    if isinstance(out, list | tuple):
        return list(out), None
    first = out.outputs[0]
    return list(first.token_ids), first.logprobs


def greedy_agreement(
    ref,
    got,
    tie: float = 0.1,
    tol: float = 0.2,
    router_margins=None,
    router_tie: float = 0.02,
    min_compared: float | None = None,
) -> Agreement:
    """``ref``: RequestOutputs from generate(..., SamplingParams(temperature=0, logprobs>=2)); ``got``: the
    same from the engine under test, or its token ids alone (then only tokens are compared).

    Both must hold the same number of sequences, and each pair the same number of tokens, unless the pair
    parted at an excused split (after it, the continuations are different texts and may end elsewhere).

    ``router_margins`` (optional, from ``RouterMargins``): per sequence, per forward of the reference (the
    prefill first, then one per decode step), the smallest gap between the k-th and (k+1)-th router logit
    over its layers and rows. From the first forward whose gap is below ``router_tie`` on, a difference
    (token or logprob) ends that sequence's comparison as a router near tie: a last-bit difference in the
    hidden state may pick another expert there, a jump no tolerance on the logits can absorb.

    ``min_compared``: the fraction of the reference's tokens that must have been compared. Excused splits
    end comparisons, so without a floor a comparison that excused everything passes having checked nothing
    (with ``router_margins`` it is required: the tiny random model's router ties often sit at the prefill)."""
    if router_margins is not None and min_compared is None:
        raise ValueError(
            "router_margins excuse whole sequences: give min_compared, the floor on tokens compared"
        )
    if len(ref) != len(got):
        raise ValueError(f"{len(got)} outputs to compare with {len(ref)} reference outputs")
    splits, router_splits, worst, problems, compared, total, checkable = 0, 0, 0.0, [], 0, 0, 0
    identical = True
    for i, (r, g) in enumerate(zip(ref, got, strict=True)):
        ref_ids, ref_lps = _tokens_and_logprobs(r)
        got_ids, got_lps = _tokens_and_logprobs(g)
        if ref_lps is None or len(ref_lps) != len(ref_ids):
            raise ValueError("the reference needs logprobs (SamplingParams(logprobs>=2)) for every token")
        total += len(ref_ids)
        identical &= ref_ids == got_ids
        margins = router_margins[i] if router_margins is not None else []
        first_tie = next((j for j, m in enumerate(margins) if m < router_tie), len(ref_ids))
        checkable += min(
            first_tie, next((j for j, ra in enumerate(ref_lps) if _margin(ra) < tie), len(ref_ids))
        )
        excused = False
        for step, (ra, token) in enumerate(zip(ref_lps, got_ids)):  # noqa: B905 (lengths checked below)
            same = ra.token_id == token
            diff = abs(ra.logprob - got_lps[step].logprob) if same and got_lps is not None else 0.0
            if step >= first_tie and (not same or diff > tol):
                router_splits, excused = router_splits + 1, True
                break
            if not same:
                margin = _margin(ra)
                if margin < tie:
                    splits, excused = splits + 1, True
                else:
                    problems.append(
                        f"sequence {i} step {step}: {token} != {ra.token_id} (margin {margin:.3f})"
                    )
                break
            compared += 1
            worst = max(worst, diff)
        if not excused and len(got_ids) != len(ref_ids):
            problems.append(f"sequence {i}: {len(got_ids)} tokens where the reference has {len(ref_ids)}")
    if worst > tol:
        problems.append(f"chosen-token logprobs differ by {worst:.4f} > {tol}")
    if min_compared is not None and compared < min_compared * total:
        problems.append(f"only {compared} of {total} tokens compared (floor {min_compared:.0%})")
    return Agreement(
        not problems, identical, splits, worst, "; ".join(problems), router_splits, compared, total, checkable
    )


def _margin(step) -> float:
    """The reference's gap between its two best logprobs at a step (inf with fewer than two)."""
    top = sorted(step.top_logprobs.values(), reverse=True)
    return top[0] - top[1] if len(top) > 1 else float("inf")


class RouterMargins:
    """Records, while active, the smallest gap between the k-th and (k+1)-th router logit of every forward
    through the engine's CPU modules (``SparseMoE.route``): ``forwards`` gets one number per model
    forward (the minimum over its MoE layers and rows; infinite where every expert is chosen). Use one
    sequence at a time to map forwards to steps."""

    def __init__(self, num_moe_layers: int):
        self.num_moe_layers, self.gaps, self._orig = num_moe_layers, [], None

    def __enter__(self):
        import torch

        from fp4moe.layers.moe import SparseMoE

        self._orig = orig = SparseMoE.route
        gaps = self.gaps

        def route(moe, x):
            logits = moe.gate(x).float()
            if moe.top_k >= logits.shape[-1]:  # every expert chosen: no choice to get wrong
                gaps.append(math.inf)
            else:
                top = torch.topk(logits, moe.top_k + 1, dim=-1).values
                gaps.append(float((top[:, -2] - top[:, -1]).min()))
            return orig(moe, x)

        SparseMoE.route = route
        return self

    def __exit__(self, *exc):
        from fp4moe.layers.moe import SparseMoE

        SparseMoE.route = self._orig

    @property
    def forwards(self) -> list[float]:
        n = self.num_moe_layers
        return [min(self.gaps[j : j + n]) for j in range(0, len(self.gaps), n)]
