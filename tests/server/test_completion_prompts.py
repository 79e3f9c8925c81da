"""``/v1/completions`` as lm-evaluation-harness and vLLM's clients use it: every prompt form, ``echo`` with the
prompt tokens' logprobs (vLLM's shape), scored against transformers' fp32 forward on the same weights.

Tolerance: prompt logprobs within 1e-4 of transformers' fp32 log-softmax (the server runs the fp32 model;
the two differ in summation order only: measured worst 9.5e-7 on these prompts, logits agree to ~2e-6 as
tests/engine/test_parity.py measures)."""

import json

import httpx
import pytest
import torch
from test_limits import _assert_error, _post

import fp4moe.engine.reference.prompt_logprobs as prompt_logprobs

ATOL = 1e-4
GREEDY = {"temperature": 0, "ignore_eos": True}


def _prompts(seed: int, lengths) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 1000, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def reference(checkpoints):
    from fixtures import transformers_reference

    return transformers_reference(checkpoints.bf16())


@torch.no_grad()
def _ref_logprobs(ref, ids: list[int]) -> torch.Tensor:
    """logprob of token i given tokens < i, for i >= 1 [len - 1]."""
    logprobs = ref(input_ids=torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return logprobs[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_every_prompt_form_has_its_own_choices_in_order(server):
    tok = server.engine.prompts.tokenizer
    texts = ["def f(x):", "import os\n"]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    alone = [
        _post(server, "/completions", {"prompt": t, "max_tokens": 4, **GREEDY}).json()["choices"][0]["text"]
        for t in texts
    ]
    for prompt in (texts, ids):
        r = _post(server, "/completions", {"prompt": prompt, "max_tokens": 4, "n": 2, **GREEDY})
        assert r.status_code == 200, r.text
        body = r.json()
        assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]  # prompt x n + choice, vLLM's order
        assert [c["text"] for c in body["choices"]] == [alone[0], alone[0], alone[1], alone[1]]
        assert body["usage"]["prompt_tokens"] == sum(len(i) for i in ids)  # each prompt once
        assert body["usage"]["completion_tokens"] == 16
    for prompt, expect in ((texts[1], alone[1]), (ids[1], alone[1])):  # a single text, a single id list
        r = _post(server, "/completions", {"prompt": prompt, "max_tokens": 4, **GREEDY}).json()
        assert [c["text"] for c in r["choices"]] == [expect]


def test_echo_logprobs_equal_transformers_in_vllms_shape(server, reference):
    tok = server.engine.prompts.tokenizer
    prompts = _prompts(0, (7, 70, 3))  # 70 > the Gated DeltaNet chunk of 64
    r = _post(server, "/completions", {"prompt": prompts, "max_tokens": 0, "echo": True, "logprobs": 2})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    worst = 0.0
    for ids, c in zip(prompts, choices, strict=True):
        lp = c["logprobs"]
        assert c["text"] == tok.decode(ids)  # max_tokens 0: the prompt alone, nothing generated
        assert lp["tokens"] == [tok.decode([t]) for t in ids]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        offsets = [0]
        for t in lp["tokens"][:-1]:
            offsets.append(offsets[-1] + len(t))
        assert lp["text_offset"] == offsets
        for t, v, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:], strict=True):
            assert top[t] == v and 2 <= len(top) <= 3  # its own logprob and the top 2 (vLLM's k + 1)
            assert max(top.values()) >= v
        ref = _ref_logprobs(reference, ids)
        ours = torch.tensor(lp["token_logprobs"][1:], dtype=torch.float32)
        torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)
        worst = max(worst, float((ours - ref).abs().max()))
    print(f"worst |server - transformers| prompt logprob: {worst:.2e}")


def test_echo_with_generation_puts_the_prompt_first(server):
    tok = server.engine.prompts.tokenizer
    ids = _prompts(1, (9,))[0]
    plain = _post(server, "/completions", {"prompt": ids, "max_tokens": 3, "logprobs": 1, **GREEDY}).json()
    echo = _post(
        server, "/completions", {"prompt": ids, "max_tokens": 3, "logprobs": 1, "echo": True, **GREEDY}
    ).json()
    p, e = plain["choices"][0], echo["choices"][0]
    assert e["text"] == tok.decode(ids) + p["text"]
    assert e["logprobs"]["tokens"][9:] == p["logprobs"]["tokens"]
    assert e["logprobs"]["token_logprobs"][9:] == pytest.approx(p["logprobs"]["token_logprobs"], abs=1e-6)
    assert echo["usage"] == plain["usage"]


def test_prompt_logprobs_are_the_same_in_chunks(checkpoints, monkeypatch):
    """A prompt prefilled in several steps (chunked prefill), its rows scored a few at a time, gives what the
    whole prompt gives: no row is skipped or scored against the wrong token at a chunk's edge."""
    from conftest import start_server

    ids = _prompts(2, (150,))[0]
    body = {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0}
    whole = _post(_server := start_server(checkpoints.bf16()), "/completions", body).json()
    _server.stop()
    monkeypatch.setattr(prompt_logprobs, "CHUNK_BYTES", 4 * 7 * 1024)  # ~7 rows of the tiny vocabulary
    srv = start_server(checkpoints.bf16(), max_num_batched_tokens=32)
    try:
        chunked = _post(srv, "/completions", body).json()
    finally:
        srv.stop()
    a, b = whole["choices"][0]["logprobs"], chunked["choices"][0]["logprobs"]
    assert a["tokens"] == b["tokens"] and a["token_logprobs"][0] is None is b["token_logprobs"][0]
    assert a["token_logprobs"][1:] == pytest.approx(b["token_logprobs"][1:], abs=1e-5)


def test_an_echoed_stream_equals_the_whole_answer(server):
    body = {"prompt": _prompts(3, (6, 11)), "max_tokens": 4, "echo": True, "logprobs": 1, **GREEDY}
    whole = _post(server, "/completions", body).json()["choices"]
    text, tokens, lps = {}, {}, {}
    with httpx.stream(
        "POST", f"{server.base_url}/completions", json={**body, "stream": True}, timeout=60
    ) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            for c in json.loads(line[6:])["choices"]:
                i = c["index"]
                text[i] = text.get(i, "") + c["text"]
                if c["logprobs"]:
                    tokens[i] = tokens.get(i, []) + c["logprobs"]["tokens"]
                    lps[i] = lps.get(i, []) + c["logprobs"]["token_logprobs"]
    for c in whole:
        i = c["index"]
        assert text[i] == c["text"] and tokens[i] == c["logprobs"]["tokens"]
        assert lps[i][0] is None and lps[i][1:] == pytest.approx(
            c["logprobs"]["token_logprobs"][1:], abs=1e-6
        )


def test_bad_prompts_are_400s(server):
    vocab = server.engine.core.runner.model.args.vocab_size
    _assert_error(_post(server, "/completions", {"prompt": [[1, 2], [3, vocab]]}), 400, "out of range")
    _assert_error(_post(server, "/completions", {"prompt": [1, -1]}), 400, "prompt holds -1")
    _assert_error(_post(server, "/completions", {"prompt": [[1], [2, 1.5]]}), 400, "prompt[1] holds 1.5")
    _assert_error(_post(server, "/completions", {"prompt": []}), 400, "not empty")
    _assert_error(_post(server, "/completions", {"prompt": [[1], []]}), 400, "prompt[1] must be a non-empty")
    _assert_error(_post(server, "/completions", {"prompt": [[1], "x"]}), 400, "prompt[1] must be a non-empty")
    _assert_error(_post(server, "/completions", {"prompt": "x", "max_tokens": 0}), 400, "0 only with echo")


def test_limits_apply_to_the_requests_total(limited):
    _assert_error(
        _post(limited, "/completions", {"prompt": ["a", "b", "c"], "n": 2}), 400, "n x prompts is 2 x 3 = 6"
    )
    _assert_error(_post(limited, "/completions", {"prompt": ["x" * 1500, "y" * 1500]}), 400, "at most 2000")
    _assert_error(_post(limited, "/completions", {"prompt": [[1] * 1500, [1] * 1500]}), 400, "at most 2000")
    r = _post(limited, "/completions", {"prompt": ["a", "b"], "n": 2, "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 4


@pytest.fixture(scope="module")
def limited(checkpoints):
    from conftest import start_server

    srv = start_server(
        checkpoints.bf16(),
        max_waiting=8,
        server_config={"max_n_sequences": 4, "max_prompt_chars": 2000, "max_request_bytes": 40_000},
    )
    yield srv
    srv.stop()


def test_a_prefix_cache_does_not_skip_prompt_logprobs(checkpoints):
    """A cached prefix is not run again, so it could not be scored: requests for prompt logprobs bypass the
    prefix cache (as vLLM's do) and get every prompt token's."""
    from conftest import start_server
    from fp4moe.engine.loop.prefix_cache import PrefixCache

    ids = _prompts(4, (40,))[0]
    body = {"prompt": ids, "max_tokens": 1, "echo": True, "logprobs": 0, **GREEDY}
    srv = start_server(checkpoints.bf16(), prefix_cache=PrefixCache(block_size=16))
    try:
        _post(srv, "/completions", {"prompt": ids, "max_tokens": 1, **GREEDY})  # caches the prefix
        scored = _post(srv, "/completions", body).json()["choices"][0]["logprobs"]["token_logprobs"]
    finally:
        srv.stop()
    plain = _post(_server := start_server(checkpoints.bf16()), "/completions", body).json()
    _server.stop()
    assert len(scored) == 41 and scored[0] is None and None not in scored[1:]
    assert scored == pytest.approx(plain["choices"][0]["logprobs"]["token_logprobs"], abs=1e-5)
