"""``fp4moe eval``: perplexity, KL and top-1 agreement against bf16; or lm-evaluation-harness tasks on both
models, side by side (``--tasks``)."""

from __future__ import annotations

from pathlib import Path

from fp4moe.cli.options import (
    DEVICE_HELP,
    check_device,
    resolve_device,
)


def add(sub) -> None:
    p = sub.add_parser(
        "eval",
        help="quality of a model against a reference: perplexity, KL, top-1 agreement, MTP acceptance",
        description=(
            "Run MODEL and REF (e.g. an NVFP4 checkpoint and its bf16 source) on the same held-out token "
            "windows with fp4moe's engine and report, per token over the full vocabulary: perplexity of "
            "each, KL(ref || model) mean / p99 / max, top-1 agreement, and for models with an MTP head the "
            "greedy acceptance rate of its first draft. Text: the packaged held-out split (CPython 3.11 "
            "language reference, never used for calibration) unless --text-file is given."
        ),
    )
    p.add_argument("model", help="the model to judge (checkpoint directory)")
    p.add_argument("--ref", required=True, help="the reference checkpoint (same tokenizer)")
    p.add_argument("--text-file", help="UTF-8 text to evaluate on (default: the packaged held-out split)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per window (default 512)")
    p.add_argument(
        "--limit", type=int, default=4096, help="evaluate on at most this many tokens (default 4096)"
    )
    p.add_argument("--device", default="auto", help=DEVICE_HELP)
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float16", "float32"],
        help="compute dtype (auto: the checkpoint's)",
    )
    p.add_argument("--json", help="also write the results as JSON to this file")
    p.add_argument(
        "--card",
        action="store_true",
        help="also write the results into MODEL's model card (README.md, its Quality section)",
    )
    g = p.add_argument_group(
        "lm-evaluation-harness tasks",
        "With --tasks: each model is served by fp4moe's engine on 127.0.0.1 and lm-eval's local-completions "
        "client scores the tasks (needs pip install 'lm-eval[api]'); prints REF and MODEL side by side with "
        "the delta and lm-eval's stderr, instead of the perplexity/KL report.",
    )
    g.add_argument("--tasks", help="comma-separated lm-eval task names (any task lm-eval knows)")
    g.add_argument("--include-path", help="a directory of more lm-eval task YAMLs (lm-eval's --include_path)")
    g.add_argument("--num-fewshot", type=int, help="few-shot examples per task (lm-eval's --num_fewshot)")
    g.add_argument(
        "--task-limit",
        type=float,
        help="documents per task: a count, or a fraction below 1 (lm-eval's --limit)",
    )
    g.add_argument("--batch-size", type=int, default=8, help="prompts per request to the server (default 8)")
    g.add_argument(
        "--max-model-len",
        type=int,
        help="the served engine's context, lm-eval's max_length (default: the model's)",
    )


def run(args) -> int:
    check_device(resolve_device(args.device))
    if args.tasks:
        return run_tasks(args)
    from fp4moe.eval.quality import evaluate

    text = Path(args.text_file).read_text(encoding="utf-8") if args.text_file else None
    result = evaluate(
        args.model,
        args.ref,
        text,
        seq_len=args.seq_len,
        limit=args.limit,
        device=resolve_device(args.device),
        dtype=args.dtype,
    )
    print(result.table())
    if args.card:
        write_card_quality(args, result.table())
    if args.json:
        tmp = Path(args.json).with_suffix(".tmp-json")
        tmp.write_text(result.to_json() + "\n")
        tmp.replace(args.json)
    return 0


def _markdown(table: str) -> str:
    """A table the card renders: a markdown table after a blank line; anything else as a code block."""
    head, sep, rest = table.rstrip().partition("\n|")
    return f"{head}\n\n|{rest}" if sep else f"```\n{table.rstrip()}\n```"


def write_card_quality(args, table: str) -> None:
    """The measured table into MODEL's README.md (between the card's quality markers), with how it was made."""
    from fp4moe import __version__
    from fp4moe.quantize.card import CARD_NAME, replace_quality

    what = (
        f"lm-evaluation-harness tasks {args.tasks}"
        if args.tasks
        else f"{args.limit} tokens of {Path(args.text_file).name if args.text_file else 'the packaged held-out text'} "
        f"in windows of {args.seq_len}"
    )
    for path in (args.model, args.ref):  # a published card names the checkpoints, not this machine's paths
        table = table.replace(str(path), Path(path).name)
    replace_quality(
        Path(args.model) / CARD_NAME,
        f"Measured with fp4moe {__version__} (`fp4moe eval`) against the bf16 reference `{Path(args.ref).name}`, "
        f"{what}, on {resolve_device(args.device)}:\n\n{_markdown(table)}",
    )


def run_tasks(args) -> int:
    """lm-eval's tasks on REF, then on MODEL (one model in memory at a time); the side-by-side table."""
    import json

    from fp4moe.engine.front.config import EngineConfig
    from fp4moe.eval.harness import run_tasks as harness_tasks
    from fp4moe.eval.harness import side_by_side
    from fp4moe.server.in_process import served

    config = EngineConfig(
        dtype=args.dtype, device=resolve_device(args.device), max_model_len=args.max_model_len
    )
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    limit = args.task_limit if args.task_limit is None or args.task_limit < 1 else int(args.task_limit)
    results = {}
    for name, path in (("reference", args.ref), ("model", args.model)):
        results[name] = harness_tasks(
            path, config, tasks, args.include_path, limit, args.num_fewshot, args.batch_size, serve=served
        )
    table = side_by_side(results["reference"], results["model"], (f"ref {args.ref}", f"model {args.model}"))
    print(table)
    if args.card:
        write_card_quality(args, table)
    if args.json:
        tmp = Path(args.json).with_suffix(".tmp-json")
        tmp.write_text(json.dumps({"reference": args.ref, "model": args.model, **results}, indent=2) + "\n")
        tmp.replace(args.json)
    return 0
