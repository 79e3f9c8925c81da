"""The response models (``server/responses.py``): what the routes send is exactly their shape -- every body and
every stream event validates against its model with no extra key, fields OpenAI leaves out are left out
(never sent as null), and the OpenAPI document names the models."""

import json

import httpx
import pytest
from pydantic import BaseModel

from fp4moe.server.responses import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
)

CHAT = {
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 5,
    "temperature": 0,
    "ignore_eos": True,
}
COMPLETION = {"prompt": "The sky is", "max_tokens": 5, "temperature": 0, "ignore_eos": True}


def _exact(model: type[BaseModel], body: dict) -> BaseModel:
    """The body as ``model``, dumped back to the same JSON: no key added, dropped or retyped."""
    parsed = model.model_validate(body)
    assert json.loads(parsed.model_dump_json()) == body
    return parsed


def _events(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{server.base_url}{path}", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_whole_answers_are_their_models(server):
    chat = httpx.post(
        f"{server.base_url}/chat/completions", json={**CHAT, "logprobs": True, "top_logprobs": 2}
    )
    parsed = _exact(ChatCompletionResponse, chat.json())
    assert len(parsed.choices[0].logprobs.content) == 5
    assert all(len(lp.top_logprobs) == 2 for lp in parsed.choices[0].logprobs.content)
    assert "tool_calls" not in chat.json()["choices"][0]["message"]  # none made: left out, not null
    completion = httpx.post(f"{server.base_url}/completions", json={**COMPLETION, "logprobs": 1})
    parsed = _exact(CompletionResponse, completion.json())
    assert parsed.usage.completion_tokens == 5 and len(parsed.choices[0].logprobs.tokens) == 5
    models = _exact(ModelList, httpx.get(f"{server.base_url}/models").json())
    _exact(ModelCard, httpx.get(f"{server.base_url}/models/{models.data[0].id}").json())
    missing = httpx.get(f"{server.base_url}/models/nope")
    assert missing.status_code == 404 and _exact(ErrorResponse, missing.json()).error.code == 404


@pytest.mark.parametrize("path,body,model", [
    ("/chat/completions", CHAT, ChatCompletionChunk),
    ("/completions", COMPLETION, CompletionResponse),
])  # fmt: skip
def test_stream_events_are_their_models(server, path, body, model):
    events = _events(server, path, {**body, "stream": True, "stream_options": {"include_usage": True}})
    for event in events:
        _exact(model, event)
    *chunks, last = events
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 5
    assert all("usage" not in e for e in chunks)  # only the last event carries usage
    if model is ChatCompletionChunk:
        deltas = [e["choices"][0]["delta"] for e in chunks]
        assert deltas[0] == {"role": "assistant", "content": ""}
        assert all(None not in d.values() for d in deltas)  # a delta carries only what it changes
        assert chunks[-1]["choices"][0]["finish_reason"] == "length" and deltas[-1] == {}


def test_the_openapi_document_names_the_response_models(server):
    doc = httpx.get(f"{server.root}/openapi.json").json()
    schemas = doc["components"]["schemas"]
    for name in ("ChatCompletionResponse", "CompletionResponse", "ModelList", "ErrorResponse"):
        assert name in schemas
    chat = doc["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert chat["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/ChatCompletionResponse")
    assert "text/event-stream" in chat["200"]["content"]
    assert chat["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
