"""Speculation that never loses, served: with a draft head whose drafts are rejected (the tiny checkpoint's
random MTP head), a streamed request gives plain decoding's tokens and, after its probe rounds, decodes
plainly -- the target model runs no more rows than PROBE_ROUNDS rounds' worth beyond the server without
speculation. Counted in model rows, not seconds (timing belongs in benchmarks/)."""

from __future__ import annotations

import openai

from conftest import start_server
from fp4moe.engine import spec_decode

TOKENS = 64


def _served(path, k: int) -> tuple[list[str], int, object]:
    srv = start_server(path, num_speculative_tokens=k)
    llm = srv.engine.core.llm
    rows = [0]
    # every target forward -- prefill, verification, recomputation, plain steps -- goes through the model
    llm.model.register_forward_pre_hook(lambda _, args: rows.__setitem__(0, rows[0] + args[0].numel()))
    try:
        client = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0)
        stream = client.completions.create(
            model="tiny", prompt="The Python tutorial", max_tokens=TOKENS, temperature=0, stream=True,
            logprobs=0, extra_body={"ignore_eos": True},
        )  # fmt: skip
        tokens = [t for chunk in stream for t in (chunk.choices[0].logprobs.tokens or [])]
    finally:
        srv.stop()
    return tokens, rows[0], llm.speculator


def test_a_rejected_draft_head_costs_only_its_probe(checkpoints):
    path = checkpoints.bf16()
    plain, plain_rows, _ = _served(path, 0)
    spec_tokens, spec_rows, spec = _served(path, 2)
    assert spec_tokens == plain and len(plain) == TOKENS  # greedy: the same tokens
    stats = spec.stats
    assert stats.accepted < spec_decode.MIN_ACCEPTED * spec_decode.PROBE_ROUNDS  # the head is rejected ...
    assert stats.backed_off == 1 and stats.drafts == spec_decode.PROBE_ROUNDS  # ... so it stops drafting
    # a probe round verifies k + 1 rows and recomputes the kept one (a plain step: 1 row)
    assert spec_rows - plain_rows <= (spec.k + 1) * spec_decode.PROBE_ROUNDS, (spec_rows, plain_rows)
