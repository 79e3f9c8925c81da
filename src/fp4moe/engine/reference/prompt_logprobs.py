"""Prompt logprobs (vLLM's ``prompt_logprobs``): each prompt token's logprob under the model given the tokens
before it, and the top ``k`` there, taken from the hidden states of the prefill that runs anyway.

The logits of a prompt are never materialised whole: a long prompt's [tokens, vocab] fp32 is gigabytes at
the full-size vocabulary (248,320 x 4 bytes a row), so the LM head, the log-softmax and the gathers run on
``rows_per_chunk`` rows at a time (``CHUNK_BYTES`` of fp32 logits), on whatever device the hidden states are.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fp4moe.engine.request.sampler import SampleResult

CHUNK_BYTES = (
    64 << 20
)  # fp32 logits held at once: 67 rows of the full-size vocabulary, 16,384 of the tiny one


def rows_per_chunk(vocab_size: int) -> int:
    return max(1, CHUNK_BYTES // (4 * vocab_size))


@torch.no_grad()
def score_rows(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    targets: list[int],
    k: int,
    vocab_size: int,
) -> list[SampleResult]:
    """Logprob of ``targets[i]`` under the logits of ``hidden[i]`` [n, H] (row i predicts target i) and the
    top ``k`` (token id -> logprob) of that row, chunk by chunk (``rows_per_chunk``)."""
    out: list[SampleResult] = []
    step = rows_per_chunk(vocab_size)
    for a in range(0, len(targets), step):
        b = min(a + step, len(targets))
        logprobs = compute_logits(hidden[a:b]).float().log_softmax(-1)  # [rows, V]
        index = torch.tensor(targets[a:b], dtype=torch.long, device=logprobs.device)
        chosen = logprobs.gather(1, index[:, None])[:, 0].tolist()
        if k:
            top = torch.topk(logprobs, k)
            tops = [
                dict(zip(i, v, strict=True))
                for i, v in zip(top.indices.tolist(), top.values.tolist(), strict=True)
            ]
        else:
            tops = [{} for _ in range(b - a)]
        del logprobs
        out += [SampleResult(t, lp, top) for t, lp, top in zip(targets[a:b], chosen, tops, strict=True)]
    return out


def score_chunk(seq, start: int, n: int, rows: torch.Tensor, compute_logits, vocab_size: int) -> None:
    """Extend ``seq.prompt_logprobs`` with what a prefill chunk of tokens ``start``..``start+n-1`` (hidden
    states ``rows`` [n, H]) tells: the logprobs of prompt tokens ``start+1``..``start+n`` (the first prompt
    token gets none, as vLLM's: logprob None). Positions already scored (a sequence recomputed after preemption) are skipped."""
    num_prompt = len(seq.prompt_ids)
    if start == 0 and not seq.prompt_logprobs:
        seq.prompt_logprobs.append(SampleResult(seq.prompt_ids[0]))  # nothing precedes it: no logprob
    first = max(start + 1, len(seq.prompt_logprobs))  # the first prompt token still to score
    last = min(start + n, num_prompt - 1)  # the last one this chunk's rows predict
    if first > last:
        return
    # row r (token start + r) predicts token start + r + 1
    hidden = rows[first - 1 - start : last - start]
    targets = seq.prompt_ids[first : last + 1]
    seq.prompt_logprobs += score_rows(compute_logits, hidden, targets, seq.params.prompt_logprobs, vocab_size)
