"""``fp4moe bench``: throughput, TTFT and acceptance of any OpenAI-compatible server under concurrency."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path


def add(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="measure any OpenAI-compatible server: throughput vs concurrency, TTFT, spec-decode acceptance",
        description=(
            "Drive an OpenAI-compatible server (fp4moe, vLLM, SGLang, llama.cpp) with concurrent streaming "
            "requests of real text and report TTFT, prefill tok/s, per-request, aggregate and steady (while the "
            "whole round decodes) decode tok/s, latency "
            "percentiles and speculative-decoding acceptance (from /metrics): a markdown table, JSON and a PNG."
        ),
    )
    p.add_argument(
        "--base-url", required=True, help="the server's OpenAI base URL, e.g. http://127.0.0.1:8000/v1"
    )
    p.add_argument("--model", default=None, help="model name (default: the first one /v1/models lists)")
    p.add_argument("--api-key", default=None, help="bearer token, if the server wants one")
    p.add_argument("--pp", type=int, nargs="+", default=[512], help="prompt sizes in tokens (default 512)")
    p.add_argument("--tg", type=int, nargs="+", default=[128], help="tokens to generate (default 128)")
    p.add_argument(
        "--depth",
        type=int,
        nargs="+",
        default=[0],
        help="context already in the prompt before pp (default 0)",
    )
    p.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=[1, 4, 8, 16],
        help="simultaneous requests (default 1 4 8 16)",
    )
    p.add_argument("--runs", type=int, default=3, help="rounds per setting; medians are reported (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up requests before measuring (default 1)")
    p.add_argument(
        "--prompt-file", default=None, help="text to draw prompts from (default: packaged held-out docs)"
    )
    p.add_argument(
        "--chars-per-token", type=float, default=4.0, help="text length per prompt token (default 4)"
    )
    p.add_argument("--out", default="bench-results", help="directory for bench.md, bench.json, bench.png")
    p.add_argument(
        "--allow-prefix-hits",
        action="store_true",
        help="do not give each prompt a unique prefix (by default no request can hit a prefix cache)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args) -> int:
    import asyncio

    from tqdm.auto import tqdm

    from fp4moe import __version__
    from fp4moe.bench.client import BenchConfig, rounds_json, run_bench, summarize
    from fp4moe.bench.report import describe, markdown, warnings, write_outputs
    from fp4moe.data import corpus_text

    text = Path(args.prompt_file).read_text() if args.prompt_file else corpus_text("heldout")
    cfg = BenchConfig(
        base_url=args.base_url,
        model=args.model,
        api_key=args.api_key,
        pp=args.pp,
        tg=args.tg,
        depth=args.depth,
        concurrency=args.concurrency,
        runs=args.runs,
        warmup=args.warmup,
        chars_per_token=args.chars_per_token,
        prompt_text=text,
        allow_prefix_hits=args.allow_prefix_hits,
    )
    total = len(args.pp) * len(args.tg) * len(args.depth) * sum(args.concurrency) * args.runs
    with tqdm(total=total, desc="requests", unit="req", disable=args.no_progress) as bar:
        info: dict = {}
        rounds = asyncio.run(run_bench(cfg, progress=bar.update, info=info))
    rows = summarize(rounds)
    settings = {k: getattr(args, k) for k in ("pp", "tg", "depth", "concurrency", "runs", "warmup")}
    settings |= {"chars_per_token": args.chars_per_token, "prompt_file": args.prompt_file,
                 "allow_prefix_hits": args.allow_prefix_hits}  # fmt: skip
    meta = {
        **info,
        "fp4moe": __version__,
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "settings": settings,
        "warnings": warnings(rows, args.runs),
    }
    paths = write_outputs(rows, rounds_json(rounds), Path(args.out), meta=meta)
    print(describe(meta))
    print(markdown(rows))
    for w in meta["warnings"]:
        print(f"warning: {w}")
    print(f"\nwrote {paths['markdown']}, {paths['json']}, {paths['png']}")
    return 0 if all(r["errors"] == 0 for r in rows) else 1
