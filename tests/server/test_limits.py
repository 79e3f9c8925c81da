"""Hostile and malformed requests: a 4xx with an OpenAI-shaped error at the boundary, before any work, and a
server that keeps serving; the limits (n, body, prompt characters, max_tokens, stop) with their flags."""

import json
import os
import signal
import threading
import time

import httpx
import pytest

MSG = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


def _post(srv, path, body, **kw):
    """``body`` goes over the wire as ASCII JSON, so lone surrogates travel as ``\\ud800`` escapes."""
    content = json.dumps(body, ensure_ascii=True) if isinstance(body, dict) else body
    headers = {"content-type": "application/json", **kw.pop("headers", {})}
    return httpx.post(f"{srv.base_url}{path}", content=content, headers=headers, timeout=60, **kw)


def _assert_error(r, status: int, fragment: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status, err
    assert fragment in err["message"], err
    assert len(err["message"]) <= 1024
    return err


@pytest.mark.parametrize(
    ("path", "body", "fragment"),
    [
        # text that is not valid Unicode: no tokenizer can take it
        ("/completions", {"prompt": "a\ud800b", "max_tokens": 1}, "prompt is not valid Unicode"),
        ("/chat/completions", {"messages": [{"role": "user", "content": "\udfff"}]}, "messages[0].content"),
        (
            "/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
            "not valid Unicode",
        ),
        ("/completions", {"prompt": "x", "stop": ["\ud83d"]}, "stop[0] is not valid Unicode"),
        # content parts: only text and image_url, each in its shape
        (
            "/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
            "input_audio",
        ),
        (
            "/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "url",
        ),
        (
            "/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "image_url",
        ),
        ("/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "text"),
        ("/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "content must be"),
        ("/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "role"),
        ("/chat/completions", {"messages": ["hi"]}, "messages.0"),
        # tools, tool_choice, tool_calls in the history
        (
            "/chat/completions",
            {"messages": MSG, "tools": [{"type": "function", "function": "f"}]},
            "tools.0.function",
        ),
        (
            "/chat/completions",
            {"messages": MSG, "tools": [{"function": {"name": "f", "parameters": {"properties": 3}}}]},
            "properties must be an object",
        ),
        (
            "/chat/completions",
            {"messages": MSG, "tools": [{"function": {"name": "f", "parameters": {"properties": {"a": 1}}}}]},
            "properties must be an object",
        ),
        ("/chat/completions", {"messages": MSG, "tools": [{"function": {"name": ""}}]}, "name"),
        (
            "/chat/completions",
            {"messages": MSG, "tools": [TOOL], "tool_choice": {"function": "f"}},
            "tool_choice",
        ),
        ("/chat/completions", {"messages": MSG, "tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
        ("/chat/completions", {"messages": MSG, "tools": [TOOL], "tool_choice": "required"}, "not supported"),
        (
            "/chat/completions",
            {"messages": [*MSG, {"role": "assistant", "tool_calls": "f()"}]},
            "tool_calls",
        ),
        ("/chat/completions", {"messages": [*MSG, {"role": "assistant", "tool_calls": 7}]}, "tool_calls"),
        (
            "/chat/completions",
            {
                "messages": [
                    *MSG,
                    {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]},
                ]
            },
            "JSON object",
        ),
        # numbers
        ("/completions", {"prompt": "x", "temperature": float("nan")}, "temperature"),
        ("/completions", {"prompt": "x", "top_p": float("inf")}, "top_p"),
        ("/completions", {"prompt": "x", "seed": 2**70}, "seed"),
        ("/completions", {"prompt": "x", "n": 0}, "n"),
        ("/completions", {"prompt": "x", "max_tokens": -3}, "max_tokens must be at least 1"),
        ("/chat/completions", {"messages": MSG, "max_completion_tokens": 0}, "max_tokens must be at least 1"),
        ("/completions", {"prompt": [1, 2**70]}, "integers in [0, 2147483647]"),
        ("/completions", {"prompt": "x", "top_k": 2**70}, "top_k"),
        ("/completions", {"prompt": "x", "stop_token_ids": [2**70]}, "stop_token_ids"),
        (
            "/chat/completions",
            {
                "messages": [
                    *MSG,
                    {
                        "role": "assistant",
                        "tool_calls": [{"function": {"name": "f", "arguments": "[" * 5000}}],
                    },
                ]
            },
            "JSON object",
        ),
        # the template is the server's: a request may not bring its own or change what rendering returns
        (
            "/chat/completions",
            {"messages": MSG, "chat_template_kwargs": {"chat_template": "{{ 1 }}"}},
            "chat_template",
        ),
        ("/chat/completions", {"messages": MSG, "chat_template_kwargs": {"tokenize": True}}, "tokenize"),
        ("/chat/completions", {"messages": [{"role": "user", "content": ""}] * 4097}, "messages"),
        # stop strings
        ("/completions", {"prompt": "x", "stop": ["s"] * 33}, "stop"),
        ("/completions", {"prompt": "x", "stop": "s" * 1025}, "stop"),
    ],
)
def test_malformed_requests_are_400(server, path, body, fragment):
    _assert_error(_post(server, path, {"model": "tiny", **body}), 400, fragment)


@pytest.mark.parametrize("depth", [65, 900, 960, 5000])
def test_deep_nesting_is_400(server, depth):
    """Past MAX_DEPTH (64) anywhere in the body: a 400 (a recursive walk overflowed at ~950 levels: a 500)."""
    body = b'{"model": "tiny", "prompt": "x", "extra": ' + b"[" * depth + b"]" * depth + b"}"
    r = _post(server, "/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == 400


def test_max_tokens_beyond_the_context_is_400(server):
    room = server.engine.core.max_model_len
    for value in (10**9, 2**70, room):  # the prompt takes at least one token: `room` is one too many
        err = _assert_error(
            _post(server, "/completions", {"prompt": "x", "max_tokens": value}), 400, "more than"
        )
        assert err["param"] == "max_tokens" and "--max-model-len" in err["message"]
    err = _assert_error(
        _post(server, "/chat/completions", {"messages": MSG, "max_completion_tokens": 10**9}),
        400,
        "more than",
    )
    assert err["param"] == "max_completion_tokens"
    # absent: chat may use the whole room (here the model stops at length), completions OpenAI's 16
    r = _post(server, "/completions", {"prompt": "x", "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16


def test_long_model_names_are_not_echoed(server):
    err = _assert_error(
        _post(server, "/completions", {"model": "m" * 100_000, "prompt": "x"}), 404, "does not exist"
    )
    assert len(err["message"]) < 300


def test_a_500_closes_its_connection_and_the_next_request_works(server, monkeypatch):
    def broken(prompt, params):
        raise RuntimeError("a bug")

    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        monkeypatch.setattr(server.engine, "make_sequences", broken)
        r = client.post("/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 500 and r.headers["connection"] == "close"
        assert r.json()["error"] == {
            "message": "internal error: RuntimeError",
            "type": "internal_error",
            "param": None,
            "code": 500,
        }
        monkeypatch.undo()
        r = client.post(
            "/completions", json={"prompt": "x", "max_tokens": 1}
        )  # same client: a new connection
        assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def limited(checkpoints):
    from conftest import start_server

    srv = start_server(
        checkpoints.bf16(),
        max_waiting=8,
        server_config={"max_n_sequences": 4, "max_prompt_chars": 2000, "max_request_bytes": 20_000},
    )
    calls = []
    real = srv.engine.make_sequences

    def counted(prompt, params):
        calls.append(prompt)
        return real(prompt, params)

    srv.engine.make_sequences = counted
    srv.tokenized = calls
    yield srv
    srv.stop()


def test_n_is_bounded_by_its_flag_and_the_queue(limited):
    _assert_error(_post(limited, "/completions", {"prompt": "x", "n": 5}), 400, "--max-n-sequences")
    _assert_error(_post(limited, "/completions", {"prompt": "x", "n": 10**6}), 400, "at most 4")
    r = _post(limited, "/completions", {"prompt": "x", "n": 4, "max_tokens": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 4
    assert limited.tokenized == ["x"]  # the refused ones were never tokenized


def test_max_waiting_bounds_n_below_the_flag(checkpoints):
    from conftest import start_server

    srv = start_server(checkpoints.bf16(), max_waiting=3)
    try:
        _assert_error(_post(srv, "/completions", {"prompt": "x", "n": 4}), 400, "--max-waiting")
    finally:
        srv.stop()


def test_long_conversations_are_refused_before_templating(limited, monkeypatch):
    """The sum of the messages' text is checked before the chat template renders them (rendering 300,000
    messages took 10 s of the event loop)."""
    llm = limited.engine.prompts
    rendered = []
    real = llm.apply_chat_template
    monkeypatch.setattr(llm, "apply_chat_template", lambda *a, **k: rendered.append(1) or real(*a, **k))
    messages = [{"role": "user", "content": "w" * 500}] * 5
    err = _assert_error(_post(limited, "/chat/completions", {"messages": messages}), 400, "at least 2500")
    assert err["param"] == "messages" and rendered == []


def test_limit_flags_must_be_positive(capsys):
    from fp4moe.cli import main

    for flag in ("--max-prompt-chars", "--max-request-bytes", "--max-n-sequences"):
        with pytest.raises(SystemExit) as exit_info:
            main(["serve", "m", flag, "0"])
        assert exit_info.value.code == 2 and "positive" in capsys.readouterr().err


def test_long_prompts_are_refused_before_tokenizing(limited):
    before = len(limited.tokenized)
    err = _assert_error(_post(limited, "/completions", {"prompt": "y" * 2001}), 400, "--max-prompt-chars")
    assert err["param"] == "prompt"
    messages = [{"role": "user", "content": "z" * 2001}]
    err = _assert_error(_post(limited, "/chat/completions", {"messages": messages}), 400, "2000")
    assert err["param"] == "messages"
    assert len(limited.tokenized) == before


def test_request_bodies_over_the_limit_are_413(limited):
    body = {"prompt": "x", "stop": ["s"], "padding": "p" * 30_000}
    _assert_error(_post(limited, "/completions", body), 413, "--max-request-bytes")

    def chunked():  # no Content-Length: counted as it arrives
        data = json.dumps(body).encode()
        for i in range(0, len(data), 4096):
            yield data[i : i + 4096]

    _assert_error(_post(limited, "/completions", chunked()), 413, "20000 bytes")
    r = _post(limited, "/completions", {"prompt": "x", "max_tokens": 1, "padding": "p" * 10_000})
    assert r.status_code == 200, r.text


def test_engine_death_ends_requests_in_flight(checkpoints, monkeypatch):
    """A request in flight when the engine thread dies gets an error, stream or not; it does not hang."""
    from conftest import start_server

    srv = start_server(checkpoints.bf16())
    monkeypatch.setattr(threading, "excepthook", lambda args: None)  # the thread's death is expected here
    core = srv.engine.core
    real_step = core.step
    gate = threading.Event()

    def step():
        if gate.is_set():
            raise SystemExit("simulated engine death")  # past the per-step guard (it catches Exception)
        return real_step()

    core.step = step
    results = {}

    def non_stream():
        body = {"prompt": "x", "max_tokens": 4000, "ignore_eos": True}
        results["non-stream"] = _post(srv, "/completions", body)

    try:
        thread = threading.Thread(target=non_stream)
        thread.start()
        # the non-streamed request must be in the engine before it dies (arriving after, it is answered 503
        # "not running", which is right but not what this test checks: CI met that order once)
        deadline = time.monotonic() + 30
        while not (core.scheduler.running or core.scheduler.waiting) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert core.scheduler.running or core.scheduler.waiting
        body = {"prompt": "x", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{srv.base_url}/completions", json=body, timeout=30) as r:
            events = []
            for line in r.iter_lines():
                if line:
                    events.append(line)
                if len(events) == 3:
                    gate.set()
        thread.join(30)
        assert events[-1] == "data: [DONE]"
        err = json.loads(events[-2].removeprefix("data: "))["error"]
        assert "engine stopped" in err["message"] and err["code"] == 500
        _assert_error(results["non-stream"], 500, "engine stopped")
        _assert_error(_post(srv, "/completions", {"prompt": "x"}), 503, "not running")
    finally:
        del core.step
        srv.stop()


def _wait_for_running(root: str, n: int, timeout: float = 30.0) -> None:
    """Until the server's ``fp4moe:num_requests_running`` reaches ``n``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in httpx.get(f"{root}/metrics", timeout=10).text.splitlines():
            if line.startswith("fp4moe:num_requests_running") and float(line.rsplit(" ", 1)[1]) >= n:
                return
        time.sleep(0.05)
    raise AssertionError(f"{n} requests never ran together")


def test_sigterm_ends_long_streams_with_an_error_event_and_done(checkpoints):
    """A stream (and a non-stream request) still running when the shutdown grace period ends is stopped with
    an error event and [DONE] (a 503) before the process exits, instead of a cut connection."""
    from conftest import start_cli_server

    grace = 4.0
    proc, root = start_cli_server(checkpoints.bf16(), "--timeout-graceful-shutdown", str(grace))
    try:
        body = {"prompt": "x", "max_tokens": 8000, "ignore_eos": True}  # minutes of CPU decoding
        results = {}

        def non_stream():
            results["r"] = httpx.post(f"{root}/v1/completions", json=body, timeout=60)

        thread = threading.Thread(target=non_stream)
        thread.start()
        events, signalled = [], None
        with httpx.stream("POST", f"{root}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line:
                    events.append(line)
                if len(events) == 3 and signalled is None:  # once (blank lines follow the third event)
                    # both requests in the engine first: a non-stream request still on its way when the
                    # signal lands is refused at the door (CI once met that), not ended by the grace period
                    _wait_for_running(root, 2)
                    signalled = time.monotonic()
                    os.kill(proc.pid, signal.SIGTERM)
        ended = time.monotonic() - signalled
        thread.join(30)
        assert events[-1] == "data: [DONE]", events[-3:]
        err = json.loads(events[-2].removeprefix("data: "))["error"]
        assert err["code"] == 503 and "shutting down" in err["message"]
        # stopped 1 s (a quarter of 4 s) before the grace ends: never earlier than that (a load delays, never
        # hastens); later, generously (a loaded 2-core machine), only to catch a stop that waited for the end
        assert grace - 2.5 < ended < grace + 10, ended
        _assert_error(results["r"], 503, "shutting down")
        assert proc.wait(30) in (0, -signal.SIGTERM)
        assert b"Traceback" not in proc.stderr.read()
    finally:
        proc.kill()
