"""The real server on 127.0.0.1, driven by the official openai client."""

import base64
import io
import json
import logging
import threading
import time

import httpx
import numpy as np
import openai
import pytest

import fp4moe.engine.request.token_sampler as token_sampler_module
from fp4moe.engine.request.sampler import SampleResult

GREEDY = dict(temperature=0, max_tokens=12, extra_body={"ignore_eos": True})
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            },
        },
    }
]


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)


@pytest.fixture
def scripted(server, monkeypatch):
    """Make every sequence emit the tokens of a given text, then end (the random model cannot)."""
    tok = server.engine.prompts.tokenizer
    eos = tok.convert_tokens_to_ids("<|im_end|>")

    def script(text: str):
        ids = tok(text, add_special_tokens=False)["input_ids"] + [eos]

        def fake_sample_batch(logits, rows):
            return [SampleResult(ids[min(len(r.output_ids), len(ids) - 1)]) for r in rows]

        monkeypatch.setattr(token_sampler_module, "sample_batch", fake_sample_batch)

    return script


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    r = httpx.get(f"{server.root}/health")
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert r.json() == {"status": "ok"}
    declared = httpx.get(f"{server.root}/openapi.json").json()["paths"]["/health"]["get"]["responses"]
    assert set(declared) >= {"200", "503"}


def test_health_is_503_when_the_engine_thread_dies(checkpoints, monkeypatch):
    from conftest import start_server

    srv = start_server(checkpoints.bf16())
    sched = srv.engine.core.scheduler
    crashes = []
    monkeypatch.setattr(threading, "excepthook", crashes.append)  # the thread's death is expected here

    def crash():
        raise RuntimeError("simulated engine crash")

    try:
        assert httpx.get(f"{srv.root}/health", timeout=10).status_code == 200
        sched.has_work = crash  # the engine loop calls it outside its per-step guard: the thread dies
        _wait_until(lambda: not srv.engine._thread.is_alive(), 10, "the engine thread did not die")
        assert [type(c.exc_value) for c in crashes] == [RuntimeError]
        r = httpx.get(f"{srv.root}/health", timeout=10)
        assert r.status_code == 503 and r.headers["content-type"] == "application/json"
        assert r.json() == {"status": "engine stopped"}
    finally:
        del sched.has_work  # let shutdown (srv.stop) check the queue again
        srv.stop()


def test_chat_stream_equals_non_stream(client):
    messages = [{"role": "user", "content": "Tell me about lists."}]
    whole = client.chat.completions.create(model="tiny", messages=messages, **GREEDY)
    assert whole.usage.completion_tokens == 12 and whole.choices[0].finish_reason == "length"
    stream = client.chat.completions.create(
        model="tiny", messages=messages, stream=True, stream_options={"include_usage": True}, **GREEDY
    )
    reasoning, content, usage = "", "", None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            content += c.delta.content or ""
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
    full = whole.choices[0].message
    assert content == (full.content or "") and reasoning == (getattr(full, "reasoning_content", None) or "")
    assert usage.completion_tokens == 12 and usage.prompt_tokens == whole.usage.prompt_tokens


def test_completions_stream_and_logprobs(client):
    whole = client.completions.create(model="tiny", prompt="def f(x):", logprobs=2, **GREEDY)
    lp = whole.choices[0].logprobs
    assert len(lp.tokens) == 12 and all(v <= 0 for v in lp.token_logprobs)
    # each token's own logprob and the top 2 (vLLM's k + 1; k when the token is among them)
    assert all(
        top[t] == v and len(top) in (2, 3)
        for t, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True)
    )
    text = "".join(
        c.choices[0].text
        for c in client.completions.create(model="tiny", prompt="def f(x):", stream=True, **GREEDY)
        if c.choices
    )
    assert text == whole.choices[0].text


def test_reasoning_split(client, scripted):
    scripted("First I think about it.\n</think>\n\nThe answer is 42.")
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "?"}], max_tokens=64
    )
    msg = r.choices[0].message
    assert msg.content == "The answer is 42." and msg.reasoning_content == "First I think about it."
    parts = {"reasoning": "", "content": ""}
    for chunk in client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "?"}], max_tokens=64, stream=True
    ):
        for c in chunk.choices:
            parts["reasoning"] += getattr(c.delta, "reasoning_content", None) or ""
            parts["content"] += c.delta.content or ""
    assert parts == {"reasoning": "First I think about it.\n", "content": "The answer is 42."}


def test_thinking_off_answers_in_content(client, scripted):
    """chat_template_kwargs enable_thinking=false (Qwen3.5's switch, which vLLM's parser reads too): the template
    closes an empty reasoning block, so the whole answer is content."""
    scripted("The answer is 42.")
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "?"}], max_tokens=64,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )  # fmt: skip
    msg = r.choices[0].message
    assert msg.content == "The answer is 42." and not getattr(msg, "reasoning_content", None)


def test_tool_call_round_trip(client, scripted):
    call_text = (
        "</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
    )
    scripted(call_text)
    messages = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
    r = client.chat.completions.create(
        model="tiny", messages=messages, tools=TOOLS, tool_choice="auto", max_tokens=80
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {
        "city": "Paris",
        "days": 3,
    }
    # streamed: fragments assemble to the same call
    name, args, ids = None, "", set()
    for chunk in client.chat.completions.create(
        model="tiny", messages=messages, tools=TOOLS, max_tokens=80, stream=True
    ):
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                name = name or tc.function.name
                args += tc.function.arguments or ""
                ids.add(tc.id) if tc.id else None
            if c.finish_reason:
                assert c.finish_reason == "tool_calls"
    assert name == "get_weather" and json.loads(args) == {"city": "Paris", "days": 3} and len(ids) == 1
    # the tool's result goes back through the chat template
    scripted("</think>\n\nIt will be sunny.")
    follow = messages + [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 25C"},
    ]
    r2 = client.chat.completions.create(model="tiny", messages=follow, tools=TOOLS, max_tokens=40)
    assert (
        r2.choices[0].message.content == "It will be sunny."
        and r2.usage.prompt_tokens > r.usage.prompt_tokens
    )


def _data_url(seed):
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (48, 64, 3), dtype=np.uint8)).save(
        buf, "PNG"
    )
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_image_request(client):
    content = [
        {"type": "image_url", "image_url": {"url": _data_url(1)}},
        {"type": "text", "text": "What is this?"},
    ]
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": content}], **GREEDY
    )
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens > 20  # the image tokens count


def test_concurrent_requests_equal_sequential(client):
    prompts = [f"Request number {i} " * (i + 1) for i in range(6)]
    sequential = [
        client.completions.create(model="tiny", prompt=p, **GREEDY).choices[0].text for p in prompts
    ]
    results = [None] * len(prompts)

    def run(i):
        results[i] = client.completions.create(model="tiny", prompt=prompts[i], **GREEDY).choices[0].text

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == sequential


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        (
            {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": -1},
            400,
            "temperature",
        ),
        ({"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "does not exist"),
        ({"model": "tiny", "messages": []}, 400, "messages"),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": "word " * 9000}]},
            400,
            "maximum model length",
        ),
        (
            {
                "model": "tiny",
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "https://x.org/a.png"}}],
                    }
                ],
            },
            400,
            "not fetched",
        ),
        (
            {
                "model": "tiny",
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": _data_url(i)}} for i in range(3)
                        ],
                    }
                ],
            },
            400,
            "limit is 2",
        ),
        (
            {
                "model": "tiny",
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
                        ],
                    }
                ],
            },
            400,
            "cannot decode image",
        ),
        (
            {
                "model": "tiny",
                "messages": [{"role": "user", "content": "x"}],
                "tools": TOOLS,
                "tool_choice": {"type": "function", "function": {"name": "nope"}},
            },
            400,
            "not among the tools",
        ),
        (
            {
                "model": "tiny",
                "messages": [{"role": "user", "content": "x"}],
                "response_format": {"type": "json_object"},
            },
            400,
            "not supported",
        ),
    ],
)
def test_bad_requests_get_openai_errors(server, body, status, fragment):
    r = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert fragment in err["message"] and err["code"] == status


def test_invalid_json(server):
    r = httpx.post(
        f"{server.base_url}/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and "error" in r.json()


def test_disconnect_frees_the_request(server):
    before = server.metric("fp4moe:request_aborted_total")
    body = {"model": "tiny", "prompt": "long", "max_tokens": 2000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.base_url}/completions", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 3:
                break
    _wait_aborted(
        server, before, "fp4moe:num_requests_running", 20, "the disconnected request was not aborted"
    )
    core = server.engine.core
    assert core.kv._kv == {} and core.states._states == {}


def _wait_until(condition, seconds: float, message: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, message
        time.sleep(0.05)


def _wait_aborted(srv, aborted_before: float, gauge: str, seconds: float, message: str) -> None:
    """Until the server has counted a new aborted request and ``gauge`` (running or waiting) is back to 0."""
    _wait_until(
        lambda: srv.metric("fp4moe:request_aborted_total") > aborted_before and srv.metric(gauge) == 0,
        seconds,
        message,
    )


@pytest.fixture(scope="module")
def keyed_server(checkpoints):
    """An API key (so the key-checking middleware sits in front of every route) and one running sequence."""
    from conftest import start_server

    srv = start_server(checkpoints.bf16(), api_key="sekrit", max_num_seqs=1)
    yield srv
    srv.stop()


class _AbortTimes:
    """When the server asked the engine to abort unfinished sequences (the moment it noticed the client
    had gone), recorded by wrapping ``AsyncEngine.abort`` for the duration of a ``with`` block."""

    def __init__(self, engine):
        self.engine, self.times = engine, []

    def __enter__(self):
        real = self.engine.abort

        def abort(seqs):
            if seqs:
                self.times.append(time.monotonic())
            real(seqs)

        self.engine.abort = abort
        return self

    def __exit__(self, *exc):
        del self.engine.abort


class _AccessLog(logging.Handler):
    """Collects uvicorn.access records (the test servers run at log level warning; access lines are info)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []
        self.logger = logging.getLogger("uvicorn.access")

    def emit(self, record):
        self.records.append(record)

    def __enter__(self):
        self.level_before = self.logger.level
        self.logger.setLevel(logging.INFO)
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc):
        self.logger.removeHandler(self)
        self.logger.setLevel(self.level_before)

    def statuses(self, path: str) -> list[int]:
        return [r.args[4] for r in self.records if r.args[1] == "POST" and r.args[2] == path]


@pytest.mark.parametrize(
    ("which", "path", "body"),
    [
        ("server", "/completions", {"prompt": "long"}),
        ("keyed_server", "/chat/completions", {"messages": [{"role": "user", "content": "long"}]}),
    ],
    ids=["no-api-key", "api-key"],
)
def test_non_stream_disconnect_aborts_the_request(request, which, path, body):
    """A non-stream client that gives up (here: a 1 s read timeout) has its request aborted within 1 s (the
    server looks every 0.25 s), its cache freed, and a 499 access-log line; the generation does not run on."""
    srv = request.getfixturevalue(which)
    headers = {"authorization": "Bearer sekrit"} if which == "keyed_server" else {}
    max_tokens = 4000  # minutes of CPU decoding: only an abort ends it within the test's deadline
    body = {"model": "tiny", "max_tokens": max_tokens, "ignore_eos": True, **body}
    aborted = srv.metric("fp4moe:request_aborted_total")
    generated = srv.metric("fp4moe:generation_tokens_total")
    with _AccessLog() as log, _AbortTimes(srv.engine) as aborts:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{srv.base_url}{path}", json=body, headers=headers, timeout=1.0)
        gave_up = time.monotonic()
        _wait_aborted(
            srv,
            aborted,
            "fp4moe:num_requests_running",
            10,
            "the request of a client that timed out was not aborted",
        )
        took = aborts.times[0] - gave_up  # the server's decision, not this test's polling of /metrics
        _wait_until(lambda: 499 in log.statuses(f"/v1{path}"), 5, "no 499 in the access log")
    assert srv.metric("fp4moe:request_aborted_total") == aborted + 1
    assert srv.metric("fp4moe:num_requests_waiting") == 0
    assert srv.metric("fp4moe:generation_tokens_total") - generated < max_tokens / 2
    core = srv.engine.core
    assert not core.scheduler.has_work() and core.kv._kv == {} and core.states._states == {}
    # promptly: fewer than half the tokens were generated (above); the server's own delay, generously (a
    # loaded 2-core machine), only to catch an abort that waited for something else
    assert took < 10, took


def test_queued_request_is_aborted_when_its_client_leaves(keyed_server):
    """With max_num_seqs=1, a non-stream request queued behind a long one and given up by its client is
    aborted from the queue: it is never admitted, and the running request goes on."""
    srv, core = keyed_server, keyed_server.engine.core
    headers = {"authorization": "Bearer sekrit"}
    admitted = []
    real_on_admit = core._on_admit

    def on_admit(seq):
        admitted.append(seq)
        real_on_admit(seq)

    core._on_admit = on_admit
    aborted = srv.metric("fp4moe:request_aborted_total")
    body = {"model": "tiny", "prompt": "long", "max_tokens": 4000, "ignore_eos": True}
    try:
        with httpx.stream(
            "POST", f"{srv.base_url}/completions", json={**body, "stream": True}, headers=headers, timeout=60
        ) as running:
            lines = running.iter_lines()  # kept: a dropped line iterator closes the connection
            for _ in range(4):
                next(lines)
            assert len(admitted) == 1 and core.scheduler.running[0] is admitted[0]
            outcome, gave_up = [], []

            def queued():
                try:
                    httpx.post(f"{srv.base_url}/completions", json=body, headers=headers, timeout=1.0)
                    outcome.append("answered")
                except httpx.ReadTimeout:
                    gave_up.append(time.monotonic())
                    outcome.append("timed out")

            with _AbortTimes(srv.engine) as aborts:
                client = threading.Thread(target=queued)
                client.start()
                _wait_until(lambda: srv.metric("fp4moe:num_requests_waiting") == 1, 5, "not queued")
                client.join(10)
                assert outcome == ["timed out"]
                _wait_aborted(
                    srv,
                    aborted,
                    "fp4moe:num_requests_waiting",
                    10,
                    "the queued request of a client that timed out was not aborted",
                )
            took = aborts.times[0] - gave_up[0]  # the server's decision, not this test's polling
            # promptly: while the long request still runs (below); the delay itself generously (a loaded
            # 2-core machine), only to catch an abort that waited for something else
            assert took < 10, took
            assert srv.metric("fp4moe:num_requests_running") == 1 and len(admitted) == 1
            assert srv.metric("fp4moe:request_aborted_total") == aborted + 1
        _wait_until(lambda: srv.metric("fp4moe:num_requests_running") == 0, 10, "stream not aborted")
    finally:
        del core._on_admit
    assert len(admitted) == 1 and srv.metric("fp4moe:request_aborted_total") == aborted + 2
    assert not core.scheduler.has_work() and core.kv._kv == {} and core.states._states == {}


def test_api_key_middleware(keyed_server):
    root, url = keyed_server.root, f"{keyed_server.base_url}/models"
    expected = {
        "error": {"message": "invalid API key", "type": "authentication_error", "param": None, "code": 401}
    }
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "sekrit"}):
        r = httpx.get(url, headers=headers)
        assert r.status_code == 401 and r.json() == expected, headers
    assert httpx.get(url, headers={"authorization": "Bearer sekrit"}).status_code == 200
    assert httpx.get(f"{root}/health").status_code == 200  # only /v1/ routes need the key
    assert httpx.get(f"{root}/metrics").status_code == 200


def test_metrics_names(server, client):
    client.completions.create(model="tiny", prompt="hi", **GREEDY)
    text = httpx.get(f"{server.root}/metrics").text
    for name in (
        "fp4moe:num_requests_running",
        "fp4moe:num_requests_waiting",
        "fp4moe:kv_cache_usage_perc",
        "fp4moe:prompt_tokens_total",
        "fp4moe:generation_tokens_total",
        "fp4moe:time_to_first_token_seconds_bucket",
        "fp4moe:inter_token_latency_seconds_bucket",
        "fp4moe:e2e_request_latency_seconds_count",
    ):
        assert name in text, name


def test_kernels_compiled_after_the_warm_up_are_warned_about_and_counted(server, monkeypatch, caplog):
    """Triton's post-compile hook (called by hand: the CPU's interpreter compiles nothing) counts compiles by
    kernel; those after the warm-up's mark are logged as warnings and exported in /metrics."""
    import collections
    from types import SimpleNamespace

    pytest.importorskip("triton")
    from triton import knobs

    from fp4moe.kernels import compiles

    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    monkeypatch.setattr(compiles, "_installed", False)
    monkeypatch.setattr(compiles, "_mark", None)
    monkeypatch.setattr(compiles, "_counts", collections.Counter())
    assert compiles.watch()

    def compile_(name):
        knobs.runtime.jit_post_compile_hook(key=None, repr="", fn=SimpleNamespace(name=name), compile={},
                                            is_manual_warmup=False, already_compiled=False)  # fmt: skip

    compile_("_warm_kernel")
    assert compiles.after_mark() == {} and not caplog.records
    compiles.mark()
    compile_("_late_kernel")
    compile_("_late_kernel")
    assert compiles.after_mark() == {"_late_kernel": 2}
    assert any("_late_kernel" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)
    text = httpx.get(f"{server.root}/metrics").text
    line = next(x for x in text.splitlines() if x.startswith("fp4moe:kernel_compiles_after_warmup_total{"))
    assert 'kernel="_late_kernel"' in line and line.endswith(" 2.0")
    assert "_warm_kernel" not in text


def test_api_key_and_full_queue(checkpoints):
    from conftest import start_server

    srv = start_server(checkpoints.bf16(), api_key="sekrit", max_num_seqs=1, max_waiting=1)
    try:
        bad = openai.OpenAI(base_url=srv.base_url, api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        good = openai.OpenAI(base_url=srv.base_url, api_key="sekrit", max_retries=0)
        assert good.models.list().data[0].id == "tiny"
        statuses = []

        def run():
            try:
                good.completions.create(
                    model="tiny", prompt="x", max_tokens=400, extra_body={"ignore_eos": True}
                )
                statuses.append(200)
            except openai.RateLimitError:
                statuses.append(429)

        threads = [threading.Thread(target=run) for _ in range(5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert 429 in statuses and 200 in statuses
    finally:
        srv.stop()


def test_streamed_chat_logprobs_belong_to_their_tokens(client):
    messages = [{"role": "user", "content": "Count with me."}]
    whole = client.chat.completions.create(
        model="tiny", messages=messages, logprobs=True, top_logprobs=2, **GREEDY
    )
    expected = [(t.token, round(t.logprob, 5)) for t in whole.choices[0].logprobs.content]
    streamed = []
    for chunk in client.chat.completions.create(
        model="tiny", messages=messages, logprobs=True, top_logprobs=2, stream=True, **GREEDY
    ):
        for c in chunk.choices:
            if c.logprobs and c.logprobs.content:
                streamed += [(t.token, round(t.logprob, 5)) for t in c.logprobs.content]
    assert streamed == expected and len(expected) == 12


def test_completion_stream_logprobs(client):
    chunks = [
        c
        for c in client.completions.create(model="tiny", prompt="x", stream=True, logprobs=1, **GREEDY)
        if c.choices
    ]
    assert sum(len(c.choices[0].logprobs.tokens) for c in chunks if c.choices[0].logprobs) == 12


def test_named_tool_choice_is_forced(client, scripted):
    scripted(
        "<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>"
    )  # the model only adds parameters
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        tools=TOOLS,
        tool_choice=choice,
        max_tokens=40,
    )
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Rome"}
    name, args = None, ""
    for chunk in client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        tools=TOOLS,
        tool_choice=choice,
        max_tokens=40,
        stream=True,
    ):
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                name, args = name or tc.function.name, args + (tc.function.arguments or "")
    assert name == "get_weather" and json.loads(args) == {"city": "Rome"}


@pytest.mark.parametrize("forced", [True, False])
def test_a_call_cut_off_by_max_tokens_is_content_and_length(client, scripted, forced):
    scripted(
        ("" if forced else "</think>\n\n<tool_call>\n<function=get_weather>\n")
        + "<parameter=city>\nRome\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
    )
    choice = {"type": "function", "function": {"name": "get_weather"}} if forced else "auto"
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], tools=TOOLS, tool_choice=choice)
    r = client.chat.completions.create(**kwargs, max_tokens=6)
    assert r.choices[0].finish_reason == "length" and not r.choices[0].message.tool_calls
    assert "<tool_call>" in r.choices[0].message.content
    content, finishes = "", []
    for chunk in client.chat.completions.create(**kwargs, max_tokens=6, stream=True):
        for c in chunk.choices:
            assert not c.delta.tool_calls
            content += c.delta.content or ""
            finishes += [c.finish_reason] if c.finish_reason else []
    assert finishes == ["length"] and content == r.choices[0].message.content


@pytest.mark.parametrize(
    ("path", "body", "fragment"),
    [
        ("/completions", {"prompt": "x", "logprobs": 5000}, "logprobs"),
        ("/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ("/chat/completions", {"messages": [{"role": "user", "content": ["hi"]}]}, "content parts"),
        (
            "/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 21, "logprobs": True},
            "top_logprobs",
        ),
    ],
)
def test_more_bad_requests(server, path, body, fragment):
    r = httpx.post(f"{server.base_url}{path}", json=body, timeout=60)
    assert r.status_code == 400 and fragment in r.text, r.text


def test_unknown_routes_and_model_lookup(server):
    r = httpx.get(f"{server.base_url}/nope")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert httpx.get(f"{server.base_url}/models/tiny").json()["id"] == "tiny"
    assert httpx.get(f"{server.base_url}/models/other").status_code == 404


def test_an_engine_failure_fails_only_its_requests(server, client, monkeypatch):
    runner = server.engine.core.runner
    real = runner.run
    calls = {"n": 0}

    def broken(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated kernel failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "run", broken)
    r = httpx.post(f"{server.base_url}/completions", json={"prompt": "x", "max_tokens": 3}, timeout=60)
    assert r.status_code == 500 and "simulated kernel failure" in r.json()["error"]["message"]
    assert httpx.get(f"{server.root}/health").status_code == 200  # the engine thread survived
    assert client.completions.create(model="tiny", prompt="x", **GREEDY).usage.completion_tokens == 12
    core = server.engine.core
    assert not core.scheduler.has_work() and core.kv._kv == {}
