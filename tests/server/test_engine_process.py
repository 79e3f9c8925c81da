"""``fp4moe serve --engine-process``: the engine loop in its own process, the API front (tokenizing,
detokenizing, stop strings, SSE) in the server's. Checked against the same server with the engine on a
thread (``server``, conftest), request by request: both run the fp32 CPU path on one sequence at a time. Text,
tokens and usage are equal exactly; logprobs within 1e-5: the two processes' CPU kernels may split their
reductions over different numbers of threads (4.8e-7 apart on a 16-core GPU host; under pytest-xdist on 2 cores
a worker runs torch on one thread, the server process on two: 4.8e-7 apart too), which no token here is near
enough a tie for."""

import json
import os
import signal
import threading
import time

import httpx
import openai
import pytest
from test_server import _data_url

from conftest import start_cli_server

# the engine process, with the thread-engine fixture's server settings
PROCESS = ("--engine-process", "--served-model-name", "tiny", "--reasoning-parser", "qwen3")
PROCESS += ("--tool-call-parser", "qwen3_coder", "--enable-auto-tool-choice")


@pytest.fixture(scope="module")
def process_server(checkpoints):
    proc, root = start_cli_server(checkpoints.bf16(), *PROCESS)
    yield root
    proc.kill()
    proc.wait(10)


def _engine_pid(proc) -> int:
    """The engine process's pid, from the start-up line that names it."""
    for line in proc.stderr:
        text = line.decode()
        if "in its own process (pid " in text:
            return int(text.rsplit("pid ", 1)[1].split(")")[0])
    raise AssertionError("no engine pid in the server's output")


def _metric(root: str, name: str) -> float:
    lines = httpx.get(f"{root}/metrics").text.splitlines()
    return sum(float(x.rsplit(" ", 1)[1]) for x in lines if x.startswith(name + "{"))


def test_the_engine_process_serves_what_the_engine_thread_serves(process_server, server):
    """Greedy text, seeded samples (n = 2: the generators cross the pipe with their seeds), logprobs,
    an image (its pixels processed in the front, encoded by the engine's vision tower), usage."""
    threaded = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
    own = openai.OpenAI(base_url=f"{process_server}/v1", api_key="none", max_retries=0)
    image = [
        {"type": "image_url", "image_url": {"url": _data_url(2)}},
        {"type": "text", "text": "What is this?"},
    ]
    for kwargs in (
        dict(temperature=0, max_tokens=16, extra_body={"ignore_eos": True}),
        dict(temperature=0.9, seed=7, n=2, max_tokens=12, extra_body={"ignore_eos": True}),
    ):
        for content in ("Tell me a story", image):
            messages = [{"role": "user", "content": content}]
            a = threaded.chat.completions.create(model="tiny", messages=messages, **kwargs)
            b = own.chat.completions.create(model="tiny", messages=messages, **kwargs)
            assert [c.message.model_dump() for c in b.choices] == [c.message.model_dump() for c in a.choices]
            assert b.usage.prompt_tokens == a.usage.prompt_tokens
            assert b.usage.completion_tokens == a.usage.completion_tokens
    a = threaded.completions.create(model="tiny", prompt="The quick", max_tokens=8, temperature=0, logprobs=2)
    b = own.completions.create(model="tiny", prompt="The quick", max_tokens=8, temperature=0, logprobs=2)
    assert b.choices[0].text == a.choices[0].text
    assert b.choices[0].logprobs.tokens == a.choices[0].logprobs.tokens
    assert b.choices[0].logprobs.token_logprobs == pytest.approx(a.choices[0].logprobs.token_logprobs, abs=1e-5)


def test_streams_and_stop_strings_in_the_front(process_server, server):
    """A stop string found in the front's text ends the request there and in the engine (counted as
    finished, not aborted; its slot free again); streamed deltas add up to the whole text."""
    body = {
        "model": "tiny",
        "prompt": "Once upon a time",
        "max_tokens": 24,
        "temperature": 0,
        "ignore_eos": True,
    }
    whole = httpx.post(f"{process_server}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    assert len(whole) > 6
    stop = whole[3:5]
    cut = whole[: whole.index(stop)]
    finished, aborted = (
        _metric(process_server, "fp4moe:request_success_total"),
        _metric(process_server, "fp4moe:request_aborted_total"),
    )
    for root in (server.root, process_server):
        r = httpx.post(f"{root}/v1/completions", json={**body, "stop": [stop]}, timeout=60).json()
        assert r["choices"][0]["text"] == cut and r["choices"][0]["finish_reason"] == "stop"
    assert _metric(process_server, "fp4moe:request_success_total") == finished + 1
    assert _metric(process_server, "fp4moe:request_aborted_total") == aborted
    assert _metric(process_server, "fp4moe:num_requests_running") == 0
    deltas = []
    with httpx.stream(
        "POST", f"{process_server}/v1/completions", json={**body, "stream": True}, timeout=60
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                deltas.append(json.loads(line[6:])["choices"][0]["text"])
    assert "".join(deltas) == whole


def test_a_client_that_leaves_aborts_its_request_in_the_engine(process_server):
    aborted = _metric(process_server, "fp4moe:request_aborted_total")
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 2000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{process_server}/v1/completions", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i == 6:
                break
    deadline = time.monotonic() + 30
    while _metric(process_server, "fp4moe:request_aborted_total") == aborted:
        assert time.monotonic() < deadline, "the engine never heard of the hang-up"
        time.sleep(0.1)
    assert _metric(process_server, "fp4moe:num_requests_running") == 0


def test_an_engine_process_that_dies_fails_its_requests_then_the_server_exits(checkpoints):
    """Killed mid-request: a stream ends with an error event and [DONE], a non-stream request gets an
    OpenAI-shaped error, then the server exits 1 with the engine's reason logged (vLLM's supervision: a
    supervisor restarts it, rather than a front answering 503 forever)."""
    proc, root = start_cli_server(checkpoints.bf16(), *PROCESS)
    try:
        pid = _engine_pid(proc)
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 5000, "stream": True, "ignore_eos": True}
        whole: list[httpx.Response] = []
        waiter = threading.Thread(
            target=lambda: whole.append(
                httpx.post(f"{root}/v1/completions", json={**body, "stream": False}, timeout=120)
            )
        )
        lines = []
        with httpx.stream("POST", f"{root}/v1/completions", json=body, timeout=60) as r:
            for i, line in enumerate(r.iter_lines()):
                lines.append(line)
                if i == 2:
                    waiter.start()
                if i == 40:
                    os.kill(pid, signal.SIGKILL)
        events = [line for line in lines if line]
        assert events[-1] == "data: [DONE]" and '"error"' in events[-2]
        waiter.join(60)
        assert whole[0].status_code == 500 and "the engine stopped" in whole[0].json()["error"]["message"]
        assert proc.wait(60) == 1
        err = proc.stderr.read().decode()
        assert "the engine process was killed by SIGKILL" in err and "the server exits" in err
        assert "Traceback" not in err
    finally:
        proc.kill()
        proc.wait(10)


def test_sigterm_stops_the_front_and_the_engine_process(checkpoints):
    proc, root = start_cli_server(checkpoints.bf16(), *PROCESS)
    try:
        pid = _engine_pid(proc)
        body = {"prompt": "hello", "max_tokens": 30, "stream": True, "ignore_eos": True}
        lines = []
        with httpx.stream("POST", f"{root}/v1/completions", json=body, timeout=60) as r:
            for i, line in enumerate(r.iter_lines()):
                lines.append(line)
                if i == 4:
                    os.kill(proc.pid, signal.SIGTERM)  # mid-stream: it finishes, then both processes end
        events = [line for line in lines if line]
        assert events[-1] == "data: [DONE]" and sum(e.startswith("data: {") for e in events) == 30
        assert proc.wait(60) in (0, -signal.SIGTERM)
        deadline = time.monotonic() + 10
        while _alive(pid):
            assert time.monotonic() < deadline, "the engine process outlived the server"
            time.sleep(0.1)
        assert b"Traceback" not in proc.stderr.read()
    finally:
        proc.kill()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by its parent) counts as gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_echoed_prompt_logprobs_cross_from_the_engine_process(process_server, server):
    body = {"prompt": [[5, 9, 2, 7], [3, 1]], "max_tokens": 2, "echo": True, "logprobs": 1}
    body |= {"temperature": 0, "ignore_eos": True}
    answers = [
        httpx.post(f"{root}/completions", json=body, timeout=60).json()
        for root in (f"{process_server}/v1", server.base_url)
    ]
    for got, want in zip(answers[0]["choices"], answers[1]["choices"], strict=True):  # logprobs: module docstring
        assert {k: v for k, v in got.items() if k != "logprobs"} == {k: v for k, v in want.items() if k != "logprobs"}
        got, want = got["logprobs"], want["logprobs"]
        assert got["tokens"] == want["tokens"] and got["text_offset"] == want["text_offset"]
        assert got["token_logprobs"] == pytest.approx(want["token_logprobs"], abs=1e-5)
        assert [list(t or {}) for t in got["top_logprobs"]] == [list(t or {}) for t in want["top_logprobs"]]
        for a, b in zip(got["top_logprobs"], want["top_logprobs"], strict=True):
            assert (a or {}) == pytest.approx(b or {}, abs=1e-5)
    assert answers[0]["choices"][1]["logprobs"]["token_logprobs"][0] is None
