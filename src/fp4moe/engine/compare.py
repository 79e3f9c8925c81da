"""Comparing two engines' greedy outputs (the GPU path against the CPU reference).

Greedy decoding in bf16 may legitimately part ways where the reference's two best tokens are nearly tied:
any change of summation order can flip such an argmax. ``greedy_agreement`` walks each sequence until
the first differing token and accepts it only at a near tie (reference margin between its top two
logprobs below ``tie``); where tokens agree, the chosen token's logprobs must be within ``tol``.

Measured on the H200 (tiny random model, bf16 compute): 0.047 nats (bf16 weights, bf16 KV), 0.077 (fp8 KV),
0.109 (NVFP4 experts, whose CPU path rounds each dequantized weight to bf16 and the kernel does not) -- bf16
rounding of hidden states and logits in a different summation order; the random model's logits are flat,
so near ties are common. An indexing or scale bug moves logprobs by whole nats."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Agreement:
    ok: bool
    identical: bool
    near_tie_splits: int
    max_logprob_diff: float
    detail: str = ""


def greedy_agreement(ref, got, tie: float = 0.1, tol: float = 0.2) -> Agreement:
    """``ref``/``got``: RequestOutputs from generate(..., SamplingParams(temperature=0, logprobs>=2))."""
    splits, worst, problems = 0, 0.0, []
    for i, (r, g) in enumerate(zip(ref, got, strict=True)):
        a, b = r.outputs[0], g.outputs[0]
        for step, (ra, gb) in enumerate(zip(a.logprobs, b.logprobs, strict=False)):
            if ra.token_id != gb.token_id:
                top = sorted(ra.top_logprobs.values(), reverse=True)
                margin = top[0] - top[1] if len(top) > 1 else float("inf")
                if margin < tie:
                    splits += 1
                else:
                    problems.append(
                        f"sequence {i} step {step}: {gb.token_id} != {ra.token_id} (margin {margin:.3f})"
                    )
                break
            worst = max(worst, abs(ra.logprob - gb.logprob))
    if worst > tol:
        problems.append(f"chosen-token logprobs differ by {worst:.4f} > {tol}")
    identical = all(r.outputs[0].token_ids == g.outputs[0].token_ids for r, g in zip(ref, got, strict=True))
    return Agreement(not problems, identical, splits, worst, "; ".join(problems))
