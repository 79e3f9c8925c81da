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

from dataclasses import dataclass


@dataclass
class Agreement:
    ok: bool
    identical: bool
    near_tie_splits: int
    max_logprob_diff: float
    detail: str = ""
    router_tie_splits: int = 0


def greedy_agreement(
    ref, got, tie: float = 0.1, tol: float = 0.2, router_margins=None, router_tie: float = 0.02
):
    """``ref``/``got``: RequestOutputs from generate(..., SamplingParams(temperature=0, logprobs>=2)).

    ``router_margins`` (optional, from ``RouterMargins``): per sequence, per forward of the reference (the
    prefill first, then one per decode step), the smallest gap between the k-th and (k+1)-th router logit
    over its layers and rows. From the first forward whose gap is below ``router_tie`` on, a difference
    (token or logprob) ends that sequence's comparison as a router near tie: a last-bit difference in the
    hidden state may pick another expert there, a jump no tolerance on the logits can absorb."""
    splits, router_splits, worst, problems = 0, 0, 0.0, []
    for i, (r, g) in enumerate(zip(ref, got, strict=True)):
        a, b = r.outputs[0], g.outputs[0]
        margins = router_margins[i] if router_margins is not None else []
        first_tie = next((j for j, m in enumerate(margins) if m < router_tie), len(a.logprobs))
        for step, (ra, gb) in enumerate(zip(a.logprobs, b.logprobs, strict=False)):
            diff = abs(ra.logprob - gb.logprob) if ra.token_id == gb.token_id else float("inf")
            if step >= first_tie and diff > tol:
                router_splits += 1
                break
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
            worst = max(worst, diff)
    if worst > tol:
        problems.append(f"chosen-token logprobs differ by {worst:.4f} > {tol}")
    identical = all(r.outputs[0].token_ids == g.outputs[0].token_ids for r, g in zip(ref, got, strict=True))
    return Agreement(not problems, identical, splits, worst, "; ".join(problems), router_splits)


class RouterMargins:
    """Records, while active, the smallest gap between the k-th and (k+1)-th router logit of every forward
    through the engine's CPU modules (``SparseMoE.route``): ``forwards`` gets one number per model
    forward (the minimum over its MoE layers and rows). Use one sequence at a time to map forwards to
    steps."""

    def __init__(self, num_moe_layers: int):
        self.num_moe_layers, self.gaps, self._orig = num_moe_layers, [], None

    def __enter__(self):
        import torch

        from fp4moe.layers.moe import SparseMoE

        self._orig = orig = SparseMoE.route
        gaps = self.gaps

        def route(moe, x):
            top = torch.topk(moe.gate(x).float(), moe.top_k + 1, dim=-1).values
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
