"""Clients that hang up mid-request, under load, over loopback: bounded in count (90) and time."""

import asyncio
import gc
import json
import random
import time

import httpx
import pytest

REQUESTS = 90
CONCURRENCY = 16
LONG = 4000  # max_tokens of a request whose client hangs up: minutes of decoding unless it is aborted
GIVE_UP = 1.5  # seconds: the read timeout of a non-stream client that hangs up (time to reach the server)
EVENTS_BEFORE_HANGUP = 3  # stream events a streaming client reads before it hangs up


@pytest.fixture
def hangup_server(checkpoints):
    from conftest import start_server

    srv = start_server(checkpoints.bf16(), max_num_seqs=4)
    yield srv
    srv.stop()


def _jobs(rng: random.Random) -> list[dict]:
    """Every third client hangs up (streams after a few events, others on a short timeout); the rest ask
    for a few tokens. Streaming or not and chat or completions alternate."""
    jobs = []
    for i in range(REQUESTS):
        hangup = i % 3 == 0
        chat = rng.random() < 0.5
        stream = (i // 3) % 2 == 0 if hangup else rng.random() < 0.5
        max_tokens = LONG if hangup else rng.randint(1, 8)
        body = {"model": "tiny", "max_tokens": max_tokens, "stream": stream, "temperature": 0.8, "seed": i}
        text = " ".join(["word"] * rng.randint(1, 40))
        if chat:
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        if stream:
            body["stream_options"] = {"include_usage": True}
        if hangup:
            body["ignore_eos"] = True
        route = "/chat/completions" if chat else "/completions"
        jobs.append({"i": i, "route": route, "body": body, "hangup": hangup})
    return jobs


def _check_usage(usage: dict, max_tokens: int) -> str | None:
    ok = (
        isinstance(usage, dict)
        and usage.get("prompt_tokens", 0) > 0
        and 1 <= usage.get("completion_tokens", 0) <= max_tokens
        and usage.get("total_tokens") == usage["prompt_tokens"] + usage["completion_tokens"]
    )
    return None if ok else f"usage {usage} for max_tokens={max_tokens}"


@pytest.mark.slow
def test_clients_hanging_up_under_load(hangup_server):
    """A third of 90 clients (16 at a time) hang up: streaming ones after a few events, non-stream ones on a
    0.75 s timeout, while asking for 4000 tokens. The others get their answers; every hung-up request is
    aborted (running or queued), nothing is left in the caches or slots, and memory is back to baseline."""
    import psutil

    srv = hangup_server
    core = srv.engine.core
    proc = psutil.Process()
    httpx.post(f"{srv.base_url}/completions", json={"prompt": "warm up", "max_tokens": 2}, timeout=60)
    gc.collect()
    baseline = proc.memory_info().rss
    aborted_before = srv.metric("fp4moe:request_aborted_total")
    jobs = _jobs(random.Random(0))
    outcomes: dict[int, str] = {}  # "ok", "hung up", or what went wrong

    async def one(client: httpx.AsyncClient, job: dict) -> None:
        body, route = job["body"], job["route"]
        if job["hangup"] and body["stream"]:
            async with client.stream("POST", route, json=body) as r:
                if r.status_code != 200:
                    outcomes[job["i"]] = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
                    return
                events = 0
                async for line in r.aiter_lines():
                    events += line.startswith("data: ")
                    if events == EVENTS_BEFORE_HANGUP:
                        break
            outcomes[job["i"]] = "hung up" if events == EVENTS_BEFORE_HANGUP else f"{events} events only"
        elif job["hangup"]:
            try:
                r = await client.post(route, json=body, timeout=GIVE_UP)
                outcomes[job["i"]] = f"answered before the hang-up: HTTP {r.status_code}"
            except httpx.ReadTimeout:
                outcomes[job["i"]] = "hung up"
        else:
            r = await client.post(route, json=body)
            if r.status_code != 200:
                outcomes[job["i"]] = f"HTTP {r.status_code}: {r.text[:300]}"
                return
            if body["stream"]:
                events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
                if events[-1:] != ["[DONE]"]:
                    outcomes[job["i"]] = f"stream without [DONE]: {r.text[-300:]!r}"
                    return
                usage = json.loads(events[-2]).get("usage")
            else:
                usage = r.json()["usage"]
            outcomes[job["i"]] = _check_usage(usage, body["max_tokens"]) or "ok"

    async def run() -> None:
        sem = asyncio.Semaphore(CONCURRENCY)
        async with httpx.AsyncClient(
            base_url=srv.base_url, timeout=20, limits=httpx.Limits(max_connections=CONCURRENCY + 8)
        ) as client:

            async def limited(job):
                async with sem:
                    try:
                        await one(client, job)
                    except httpx.HTTPError as e:  # e.g. a request stuck behind hang-ups never aborted
                        outcomes[job["i"]] = f"{type(e).__name__}: {e}"

            await asyncio.wait_for(asyncio.gather(*(limited(j) for j in jobs)), timeout=90)

    start = time.monotonic()
    asyncio.run(run())
    took = time.monotonic() - start
    hangups = sum(j["hangup"] for j in jobs)
    expected = {j["i"]: "hung up" if j["hangup"] else "ok" for j in jobs}
    wrong = {
        i: (jobs[i]["route"], jobs[i]["body"]["stream"], o) for i, o in outcomes.items() if o != expected[i]
    }
    assert not wrong and len(outcomes) == REQUESTS, wrong

    # a non-stream client is looked at every fraction of a second: allow a few seconds for the last aborts
    deadline = time.monotonic() + 10
    while True:
        aborted = srv.metric("fp4moe:request_aborted_total") - aborted_before
        running = srv.metric("fp4moe:num_requests_running")
        waiting = srv.metric("fp4moe:num_requests_waiting")
        if (aborted >= hangups and running == 0 and waiting == 0) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert (aborted, running, waiting) == (hangups, 0, 0), f"aborted {aborted} of {hangups} hang-ups"
    assert not core.scheduler.has_work() and core.kv._kv == {} and core.states._states == {}
    assert len(core.scheduler.free_slots) == core.scheduler.config.max_num_seqs
    assert srv.metric("fp4moe:generation_tokens_total") < hangups * LONG / 10  # aborts, not completions
    r = httpx.get(f"{srv.root}/health", timeout=10)
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    gc.collect()
    assert proc.memory_info().rss - baseline < 200 << 20  # transient buffers only; caches are gone
    assert took < 60, took
