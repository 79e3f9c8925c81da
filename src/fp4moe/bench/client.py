"""Load generator for any OpenAI-compatible server (ours, vLLM, SGLang, llama.cpp).

For each prompt size (pp), generation size (tg), context depth and concurrency, ``runs`` rounds of
``concurrency`` simultaneous streaming requests. Prompts are real text (the packaged held-out corpus, or
--prompt-file), each with a unique prefix so no request hits a prefix cache. Token counts come from the
server's ``usage`` (stream_options.include_usage), never from counting chunks -- speculative decoding sends
several tokens per chunk. Spec-decode acceptance is read from /metrics before and after each round.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
import uuid
from dataclasses import asdict, dataclass, field

import httpx

from fp4moe.errors import UserError

SPEC_METRICS = {  # vLLM's names, and ours
    "drafts": ("vllm:spec_decode_num_drafts_total", "fp4moe:spec_decode_num_drafts_total"),
    "draft_tokens": ("vllm:spec_decode_num_draft_tokens_total", "fp4moe:spec_decode_num_draft_tokens_total"),
    "accepted": (
        "vllm:spec_decode_num_accepted_tokens_total",
        "fp4moe:spec_decode_num_accepted_tokens_total",
    ),
    # ours only: the online policy's backoffs, and requests that started backed off
    "backoffs": ("fp4moe:spec_decode_num_backoffs_total",),
    "started_backed_off": ("fp4moe:spec_decode_num_started_backed_off_total",),
    "batch_backoffs": ("fp4moe:spec_decode_num_batch_backoffs_total",),
}


@dataclass
class BenchConfig:
    base_url: str
    model: str | None = None
    api_key: str | None = None
    pp: list[int] = field(default_factory=lambda: [512])
    tg: list[int] = field(default_factory=lambda: [128])
    depth: list[int] = field(default_factory=lambda: [0])
    concurrency: list[int] = field(default_factory=lambda: [1, 4, 8, 16])
    runs: int = 3
    warmup: int = 1
    chars_per_token: float = 4.0
    prompt_text: str = ""
    timeout: float = 600.0
    seed: int = 0
    allow_prefix_hits: bool = False  # keep prompts free of a unique prefix (measure the prefix cache)

    def __post_init__(self):
        for name in ("pp", "tg", "concurrency"):
            if any(v < 1 for v in getattr(self, name)):
                raise ValueError(f"--{name} values must be positive")
        if self.runs < 1:
            raise ValueError("--runs must be at least 1")


@dataclass
class RequestResult:
    ok: bool
    error: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft: float = 0.0  # first chunk of any kind
    ttft_content: float = 0.0  # first chunk carrying text
    e2e: float = 0.0
    decode_tps: float = 0.0
    # perf_counter() of each chunk that carried text (not in the JSON: one float per token): the round's
    # steady decode window is read from them
    chunk_times: list[float] = field(default_factory=list, repr=False)


@dataclass
class RoundResult:
    pp: int
    tg: int
    depth: int
    concurrency: int
    requests: list[RequestResult]
    wall: float
    spec: dict[str, float] = field(default_factory=dict)


def bench_prompt(cfg: BenchConfig, tokens: int, rng: random.Random) -> str:
    """About ``tokens`` tokens of real text, from a random offset, after a unique nonce."""
    n = int(tokens * cfg.chars_per_token)
    text = cfg.prompt_text
    start = rng.randrange(0, max(1, len(text) - n))
    body = (text * (1 + n // max(1, len(text))))[start : start + n]
    return body if cfg.allow_prefix_hits else f"[{uuid.uuid4().hex[:8]}] {body}"


async def _one(
    client: httpx.AsyncClient, cfg: BenchConfig, model: str, prompt: str, tg: int
) -> RequestResult:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": tg,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "min_tokens": tg,
    }
    t0 = time.perf_counter()
    res = RequestResult(ok=False)
    try:
        async with client.stream("POST", "/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                now = time.perf_counter() - t0
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                res.ttft = res.ttft or now
                if any(c.get("text") for c in chunk.get("choices", [])):
                    res.ttft_content = res.ttft_content or now
                    res.chunk_times.append(t0 + now)
                if chunk.get("usage"):
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    res.completion_tokens = chunk["usage"]["completion_tokens"]
        res.e2e = time.perf_counter() - t0
        first = res.ttft_content or res.ttft
        if res.completion_tokens > 1 and res.e2e > first:
            res.decode_tps = (res.completion_tokens - 1) / (res.e2e - first)
        res.ok = res.completion_tokens > 0
        if not res.ok:
            res.error = "no usage in the stream (does the server support stream_options.include_usage?)"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


PER_POSITION = (
    "vllm:spec_decode_num_accepted_tokens_per_pos_total",
    "fp4moe:spec_decode_num_accepted_tokens_per_pos_total",
)


async def _spec_counters(client: httpx.AsyncClient, root: str) -> dict[str, float]:
    """Spec-decode counters from /metrics; per-position acceptance as keys ``pos<k>``."""
    try:
        text = (await client.get(f"{root}/metrics")).text
    except httpx.HTTPError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if line.startswith("#") or not name:
            continue
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (ValueError, IndexError):  # not Prometheus text: no counters
            continue
        for key, names in SPEC_METRICS.items():
            if name in names:
                out[key] = out.get(key, 0.0) + value
        if name in PER_POSITION and 'position="' in line:
            pos = line.split('position="', 1)[1].split('"', 1)[0]
            out[f"pos{pos}"] = out.get(f"pos{pos}", 0.0) + value
    return out


async def served_model(client: httpx.AsyncClient, base_url: str) -> str:
    """The first model ``/models`` lists; a one-line ``UserError`` where no server answers or the URL is not
    an OpenAI base URL (most often: ``/v1`` left out)."""
    try:
        r = await client.get("/models")
    except httpx.HTTPError as e:
        raise UserError(
            f"no server answers at {base_url} ({type(e).__name__}); start one (fp4moe serve MODEL) or fix "
            "--base-url"
        ) from None
    try:
        return r.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        hint = "" if base_url.rstrip("/").endswith("/v1") else f"; did you mean {base_url.rstrip('/')}/v1?"
        raise UserError(
            f"{base_url}/models lists no model (HTTP {r.status_code}): --base-url must be the server's OpenAI "
            f"base URL, e.g. http://127.0.0.1:8000/v1{hint}"
        ) from None


async def server_info(client: httpx.AsyncClient, root: str, model: str) -> dict:
    """What the server says of itself: its /v1/models entry for ``model`` (max_model_len where it tells) and
    /version where it has one (vLLM)."""
    info: dict = {}
    try:
        entries = (await client.get("/models")).json().get("data", [])
        info["model_entry"] = next((e for e in entries if e.get("id") == model), None)
    except (httpx.HTTPError, ValueError, AttributeError):
        pass
    try:
        r = await client.get(f"{root}/version")
        if r.status_code == 200:
            info["version"] = r.json().get("version")
    except (httpx.HTTPError, ValueError, AttributeError):
        pass
    return info


async def run_bench(cfg: BenchConfig, progress=None, info: dict | None = None) -> list[RoundResult]:
    """Every round of the sweep; ``info``, where given, gets the model measured and what the server says of
    itself (``server_info``)."""
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    root = cfg.base_url.rstrip("/").removesuffix("/v1")
    rng = random.Random(cfg.seed)
    rounds: list[RoundResult] = []
    limits = httpx.Limits(max_connections=max(cfg.concurrency) + 4)
    async with httpx.AsyncClient(
        base_url=cfg.base_url, headers=headers, timeout=cfg.timeout, limits=limits
    ) as client:
        model = cfg.model or await served_model(client, cfg.base_url)
        if info is not None:
            info.update(model=model, server={"base_url": cfg.base_url, **await server_info(client, root, model)})
        for _ in range(cfg.warmup):
            await _one(client, cfg, model, bench_prompt(cfg, 32, rng), 8)
        for pp in cfg.pp:
            for tg in cfg.tg:
                for depth in cfg.depth:
                    for conc in cfg.concurrency:
                        for _ in range(cfg.runs):
                            before = await _spec_counters(client, root)
                            t0 = time.perf_counter()
                            results = await asyncio.gather(
                                *(
                                    _one(client, cfg, model, bench_prompt(cfg, depth + pp, rng), tg)
                                    for _ in range(conc)
                                )
                            )
                            wall = time.perf_counter() - t0
                            after = await _spec_counters(client, root)
                            spec = {k: after[k] - before.get(k, 0.0) for k in after}
                            rounds.append(RoundResult(pp, tg, depth, conc, list(results), wall, spec))
                            if progress is not None:
                                progress(conc)
    return rounds


def steady_decode(requests: list[RequestResult]) -> tuple[float, float] | None:
    """(tokens/s, seconds) of one round while every one of its requests was decoding: from the last first
    token to the first last token, the text chunks in that window, each worth its request's tokens per chunk
    (speculation sends several). This is the batch's decode rate at its context, free of the prefills and
    the stragglers around it; None when the window is empty (a request ended before the last one started)."""
    reqs = [q for q in requests if q.ok and len(q.chunk_times) > 1]
    if not reqs or len(reqs) < len(requests):
        return None
    lo, hi = max(q.chunk_times[0] for q in reqs), min(q.chunk_times[-1] for q in reqs)
    if hi <= lo:
        return None
    tokens = 0.0
    for q in reqs:
        per_chunk = q.completion_tokens / len(q.chunk_times)
        tokens += per_chunk * sum(lo < t <= hi for t in q.chunk_times)
    return tokens / (hi - lo), hi - lo


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def summarize(rounds: list[RoundResult]) -> list[dict]:
    """One row per (pp, tg, depth, concurrency): medians over requests/rounds, aggregates over rounds."""
    groups: dict[tuple, list[RoundResult]] = {}
    for r in rounds:
        groups.setdefault((r.pp, r.tg, r.depth, r.concurrency), []).append(r)
    rows = []
    for (pp, tg, depth, conc), rs in groups.items():
        reqs = [q for r in rs for q in r.requests if q.ok]
        errors = sum(not q.ok for r in rs for q in r.requests)
        aggregate = [sum(q.completion_tokens for q in r.requests if q.ok) / r.wall for r in rs if r.wall > 0]
        keys = {k for r in rs for k in r.spec}
        spec = {k: sum(r.spec.get(k, 0.0) for r in rs) for k in keys | {"drafts", "draft_tokens", "accepted"}}
        steady = [w for w in (steady_decode(r.requests) for r in rs) if w is not None]
        row = {
            "pp": pp,
            "tg": tg,
            "depth": depth,
            "concurrency": conc,
            "requests": len(reqs),
            "errors": errors,
            "prompt_tokens": statistics.median([q.prompt_tokens for q in reqs]) if reqs else 0,
            "ttft_s_median": statistics.median([q.ttft for q in reqs]) if reqs else float("nan"),
            "ttft_s_p90": _pct([q.ttft for q in reqs], 0.9),
            "ttft_content_s_median": statistics.median([q.ttft_content or q.ttft for q in reqs])
            if reqs
            else float("nan"),
            "prefill_tps_median": statistics.median([q.prompt_tokens / q.ttft for q in reqs if q.ttft])
            if reqs
            else 0,
            "decode_tps_per_request_median": statistics.median([q.decode_tps for q in reqs]) if reqs else 0,
            "aggregate_tps_median": statistics.median(aggregate) if aggregate else 0,
            # the batch's decode rate while all of it decoded (None: no such window in any round)
            "decode_steady_tps_median": statistics.median([w[0] for w in steady]) if steady else None,
            "steady_window_s_median": statistics.median([w[1] for w in steady]) if steady else None,
            "e2e_s_p50": _pct([q.e2e for q in reqs], 0.5),
            "e2e_s_p90": _pct([q.e2e for q in reqs], 0.9),
            "e2e_s_p99": _pct([q.e2e for q in reqs], 0.99),
            # each timed round's own median: the spread between runs beside the medians above
            "per_run": {
                "decode_tps_per_request": [_median([q.decode_tps for q in r.requests if q.ok]) for r in rs],
                "ttft_s": [_median([q.ttft for q in r.requests if q.ok]) for r in rs],
                "aggregate_tps": aggregate,
            },
        }
        if spec["drafts"] > 0:
            row["spec_acceptance_rate"] = spec["accepted"] / max(spec["draft_tokens"], 1)
            row["spec_mean_acceptance_length"] = 1 + spec["accepted"] / spec["drafts"]
            positions = sorted((int(k[3:]), v) for k, v in spec.items() if k.startswith("pos"))
            if positions:
                row["spec_acceptance_per_position"] = [v / spec["drafts"] for _, v in positions]
        for key in (
            "backoffs",
            "started_backed_off",
            "batch_backoffs",
        ):  # fp4moe's speculation policy (a request that starts
            if key in keys:  # backed off may draft nothing at all)
                row[f"spec_{key}"] = int(spec[key])
        rows.append(row)
    return rows


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def rounds_json(rounds: list[RoundResult]) -> list[dict]:
    out = [asdict(r) for r in rounds]
    for r in out:
        for q in r["requests"]:
            del q["chunk_times"]
    return out
