"""lm-eval accuracy and perplexity of NVFP4 choices on a trained reference model, beside the KL that
``quality.py`` measures: a multiple-choice task built from the held-out text (which line comes next, among
4: the true one and 3 other lines of the held-out text) and the rolling perplexity of the held-out text,
for bf16, rtn, mse, gptq + mse and the recommended FP8 mix -- each scored by lm-eval's ``local-completions``
client against our engine (``fp4moe eval --tasks``'s harness) -- and each variant's KL(bf16 || model) on the
same text (``fp4moe eval``).

    python benchmarks/lm_eval_quality.py .models/reference --out lm-eval-quality.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

# (name, scale method, gptq, --quantize mix): the variants compared
VARIANTS = [
    ("rtn", "rtn", False, ()),
    ("mse", "mse", False, ()),
    ("gptq + mse", "mse", True, ()),
    ("mse + FP8 attention, deltanet, shared", "mse", False, ("attention:fp8", "deltanet:fp8", "shared:fp8")),
]

MC_YAML = """task: heldout_next_line
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: multiple_choice
test_split: test
doc_to_text: "{{{{context}}}}"
doc_to_choice: choices
doc_to_target: label
target_delimiter: ""
metric_list:
  - metric: acc
  - metric: acc_norm
metadata:
  version: 1.0
"""

ROLLING_YAML = """task: heldout_rolling
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: loglikelihood_rolling
test_split: test
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
metadata:
  version: 1.0
"""


def next_line_items(text: str, count: int, context_lines: int = 4, seed: int = 0) -> list[dict]:
    """``count`` items: the ``context_lines`` lines before a line of 30-200 characters, that line and 3
    other such lines of the text as distractors, in a seeded random order."""
    lines = text.split("\n")
    pool = [i for i, line in enumerate(lines) if 30 <= len(line.strip()) <= 200 and i >= context_lines]
    rng = random.Random(seed)
    items = []
    for i in sorted(rng.sample(pool, min(count, len(pool)))):
        true = lines[i]
        others = set()
        while len(others) < 3:
            j = rng.choice(pool)
            if lines[j] != true:
                others.add(lines[j])
        choices = [true, *sorted(others)]
        rng.shuffle(choices)
        context = "\n".join(lines[i - context_lines : i]) + "\n"
        items.append({"context": context, "choices": choices, "label": choices.index(true)})
    return items


def text_docs(text: str, count: int) -> list[dict]:
    """The text in ``count`` contiguous documents, cut at paragraph breaks."""
    docs, start = [], 0
    for k in range(1, count):
        at = text.find("\n\n", k * len(text) // count)
        docs.append({"text": text[start:at]})
        start = at
    docs.append({"text": text[start:]})
    return docs


def write_tasks(folder: Path, items: int, docs: int, rolling_fraction: float) -> None:
    from fp4moe.data import corpus_text

    text = corpus_text("heldout")
    rolled = text[: int(len(text) * rolling_fraction)]
    for name, rows, yaml in (
        ("heldout_next_line", next_line_items(text, items), MC_YAML),
        ("heldout_rolling", text_docs(rolled, docs), ROLLING_YAML),
    ):
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (folder / f"{name}.yaml").write_text(yaml.format(data=data))


def versions() -> dict:
    import lm_eval
    import torch
    import transformers

    here = Path(__file__).parent
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=here
    ).stdout.strip()
    return dict(
        commit=commit,
        python=platform.python_version(),
        torch=torch.__version__,
        transformers=transformers.__version__,
        lm_eval=lm_eval.__version__ if hasattr(lm_eval, "__version__") else "0.4.13",
        device=f"{platform.machine()} CPU, {torch.get_num_threads()} threads",
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reference", help="the bf16 reference checkpoint (scripts/train_reference.py)")
    ap.add_argument("--out", default="lm-eval-quality.json", help="JSON results")
    ap.add_argument("--items", type=int, default=500, help="multiple-choice items from the held-out text")
    ap.add_argument("--docs", type=int, default=16, help="documents the rolled text is cut into")
    ap.add_argument(
        "--rolling-fraction",
        type=float,
        default=1.0,
        help="share of the held-out text, from its start, rolled",
    )
    ap.add_argument("--kl-limit", type=int, default=16384, help="held-out tokens of the KL eval")
    ap.add_argument("--num-samples", type=int, default=128, help="calibration sequences")
    ap.add_argument("--max-model-len", type=int, default=512, help="served context, lm-eval's max_length")
    names = [v[0] for v in VARIANTS]
    ap.add_argument(
        "--variants",
        nargs="+",
        choices=names,
        default=names,
        help="which quantized variants (bf16 always runs)",
    )
    args = ap.parse_args()

    from fp4moe.engine.front.config import EngineConfig
    from fp4moe.eval.harness import metrics, run_tasks
    from fp4moe.eval.quality import evaluate
    from fp4moe.quantize.options import QuantizeOptions
    from fp4moe.quantize.pipeline import quantize
    from fp4moe.server.in_process import served

    config = EngineConfig(dtype="auto", device="cpu", max_model_len=args.max_model_len)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tasks = Path(tmp) / "tasks"
        tasks.mkdir()
        write_tasks(tasks, args.items, args.docs, args.rolling_fraction)

        def score(name: str, path: str | Path, kl: dict | None) -> None:
            start = time.perf_counter()
            task_names = ["heldout_next_line", "heldout_rolling"]
            results = run_tasks(path, config, task_names, str(tasks), log_samples=True, serve=served)
            docs = sorted(results["samples"]["heldout_next_line"], key=lambda d: d["doc_id"])
            rows.append(dict(name=name, lm_eval=results["results"], answers=[_answer(d) for d in docs], kl=kl,
                             seconds=time.perf_counter() - start))  # fmt: skip
            print(name, {f"{t}/{m}": v for (t, m), v in metrics(results).items()}, flush=True)
            record = dict(command=" ".join(sys.argv), **versions(), items=args.items, docs=args.docs,
                          rolling_fraction=args.rolling_fraction, rows=rows)  # fmt: skip
            Path(args.out).write_text(
                json.dumps(record, indent=2) + "\n"
            )  # after each model: a partial run counts

        score("bf16", args.reference, None)
        for name, method, gptq, mix in [v for v in VARIANTS if v[0] in args.variants]:
            dst = Path(tmp) / name.replace(" ", "_")
            options = QuantizeOptions(scale_method=method, gptq=gptq, quantize_extra=mix, device="cpu",
                                      num_samples=args.num_samples, overwrite=True, progress=False)  # fmt: skip
            quantize(args.reference, dst, options)
            kl = asdict(
                evaluate(dst, args.reference, seq_len=args.max_model_len, limit=args.kl_limit, progress=False)
            )
            score(name, dst, kl)
    print(table(rows))


def _answer(doc: dict) -> int:
    """The choice a multiple-choice sample's loglikelihoods pick (lm-eval's acc: the largest)."""
    scores = [float(r[0]) for r in doc["filtered_resps"]]
    return max(range(len(scores)), key=scores.__getitem__)


def table(rows: list[dict]) -> str:
    """Markdown: accuracy ± stderr, perplexities, KL and top-1 agreement per variant."""
    lines = [
        "| model | next-line acc (± stderr) | acc_norm | answers unlike bf16's | word perplexity | byte perplexity "
        "| KL mean | top-1 agreement |",
        "|---|---|---|---|---|---|---|---|",
    ]
    base = rows[0]["answers"]
    for r in rows:
        flips = sum(a != b for a, b in zip(r["answers"], base, strict=True))
        mc, roll, kl = r["lm_eval"]["heldout_next_line"], r["lm_eval"]["heldout_rolling"], r["kl"]
        lines.append(
            f"| {r['name']} | {mc['acc,none']:.4f} ± {mc['acc_stderr,none']:.4f} | {mc['acc_norm,none']:.4f} | "
            f"{flips} of {len(base)} | "
            f"{roll['word_perplexity,none']:.3f} | {roll['byte_perplexity,none']:.4f} | "
            + (f"{kl['kl_mean']:.5f} | {kl['top1_agreement']:.2%} |" if kl else "0 | 100% |")
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
