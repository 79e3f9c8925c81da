"""Speculation that never loses, served: with a draft head whose drafts are rejected (the tiny checkpoint's
random MTP head), a streamed request gives plain decoding's tokens and, after its probe rounds, decodes
plainly -- the target model runs no more rows than PROBE_ROUNDS rounds' worth beyond the server without
speculation. Counted in model rows, not seconds (timing belongs in benchmarks/)."""

from __future__ import annotations

import openai

from conftest import start_server
from fp4moe.engine.spec import spec_policy

TOKENS = 64


def _served(path, k: int) -> tuple[list[tuple[str, dict]], int, object]:
    srv = start_server(path, num_speculative_tokens=k)
    core = srv.engine.core
    rows = [0]
    # every target forward -- prefill, verification, recomputation, plain steps -- goes through the model
    core.runner.model.register_forward_pre_hook(
        lambda _, args: rows.__setitem__(0, rows[0] + args[0].numel())
    )
    try:
        client = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0)
        stream = client.completions.create(
            model="tiny", prompt="The Python tutorial", max_tokens=TOKENS, temperature=0, stream=True,
            logprobs=2, extra_body={"ignore_eos": True},
        )  # fmt: skip
        tokens = [
            (t, top) for chunk in stream if chunk.choices[0].logprobs
            for t, top in zip(chunk.choices[0].logprobs.tokens, chunk.choices[0].logprobs.top_logprobs, strict=True)
        ]  # fmt: skip
    finally:
        srv.stop()
    return tokens, rows[0], core.speculator


def test_a_rejected_draft_head_costs_only_its_probe(checkpoints):
    path = checkpoints.bf16()
    plain, plain_rows, _ = _served(path, 0)
    spec_tokens, spec_rows, spec = _served(path, 2)
    assert len(spec_tokens) == len(plain) == TOKENS
    # greedy: the same tokens, but for a near tie (fp32: verification's 3-row forward sums in another order
    # than a 1-row step; a split is excused where plain decoding's top two are within 1e-4 nats)
    split = next((i for i, (a, b) in enumerate(zip(plain, spec_tokens, strict=True)) if a[0] != b[0]), None)
    if split is not None:
        first, second = sorted(plain[split][1].values(), reverse=True)[:2]
        assert first - second < 1e-4, (split, plain[split], spec_tokens[split])
    stats = spec.stats
    assert stats.accepted < spec_policy.MIN_ACCEPTED * spec_policy.PROBE_ROUNDS  # the head is rejected ...
    assert stats.backed_off == 1 and stats.drafts == spec_policy.PROBE_ROUNDS  # ... so it stops drafting
    # a probe round verifies k + 1 rows and recomputes the kept one (a plain step: 1 row)
    assert spec_rows - plain_rows <= (spec.k + 1) * spec_policy.PROBE_ROUNDS, (spec_rows, plain_rows)
