"""Request rules as vLLM applies them: ``best_of`` (equal to ``n`` or refused), ``stream_options`` only with
``stream``, ``top_logprobs`` only with ``logprobs``, the stop-string count, a case-insensitive ``Bearer``."""

import httpx
import pytest

from conftest import start_server

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
TEXT = {"prompt": "hi", "max_tokens": 2}


@pytest.mark.parametrize(
    ("path", "body", "fragment"),
    [
        ("/completions", {**TEXT, "best_of": 3}, "best_of 3 with n 1"),
        ("/completions", {**TEXT, "n": 2, "best_of": 1}, "best_of must be at least n"),
        ("/completions", {**TEXT, "best_of": 0}, "best_of"),
        (
            "/completions",
            {**TEXT, "stream_options": {"include_usage": True}},
            "only be given with stream: true",
        ),
        ("/chat/completions", {**CHAT, "stream_options": {"include_usage": True}}, "stream: true"),
        ("/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs needs logprobs: true"),
        ("/chat/completions", {**CHAT, "logprobs": False, "top_logprobs": 2}, "top_logprobs needs logprobs"),
        (
            "/completions",
            {**TEXT, "stop": [f"s{i}" for i in range(1000)]},
            "stop has 1000 strings; this server",
        ),
        ("/chat/completions", {**CHAT, "stop": ["x"] * 33}, "at most 32"),
    ],
)
def test_refused_with_a_clear_400(server, path, body, fragment):
    r = httpx.post(f"{server.base_url}{path}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and fragment in error["message"], error["message"]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/completions", {**TEXT, "best_of": 1}),
        ("/completions", {**TEXT, "n": 2, "best_of": 2}),
        ("/completions", {**TEXT, "stream": True, "stream_options": {"include_usage": True}}),
        ("/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 2}),
        ("/chat/completions", {**CHAT, "stop": [f"s{i}" for i in range(32)]}),
    ],
)
def test_accepted(server, path, body):
    r = httpx.post(f"{server.base_url}{path}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    if "best_of" in body and not body.get("stream"):
        assert len(r.json()["choices"]) == body.get("n", 1)


def test_the_bearer_scheme_is_case_insensitive_and_the_key_is_not(checkpoints):
    srv = start_server(checkpoints.bf16(), api_key="Secret-1")
    try:

        def status(header: str | None) -> int:
            headers = {"Authorization": header} if header is not None else {}
            return httpx.get(f"{srv.base_url}/models", headers=headers, timeout=30).status_code

        assert [status(f"{s} Secret-1") for s in ("Bearer", "bearer", "BEARER")] == [200, 200, 200]
        assert [status(h) for h in ("Bearer secret-1", "Basic Secret-1", "Secret-1", "bearer", None)] == [
            401
        ] * 5
    finally:
        srv.stop()
