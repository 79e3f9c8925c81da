"""``fp4moe eval``: perplexity, KL and top-1 agreement against bf16."""

from __future__ import annotations

from pathlib import Path

from fp4moe.cli.options import (
    DEVICE_HELP,
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
        "--dtype", default="auto", help="compute dtype: auto (the checkpoint's), bfloat16, float32"
    )
    p.add_argument("--json", help="also write the results as JSON to this file")


def run(args) -> int:
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
    if args.json:
        tmp = Path(args.json).with_suffix(".tmp-json")
        tmp.write_text(result.to_json() + "\n")
        tmp.replace(args.json)
    return 0
