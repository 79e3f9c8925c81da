"""lm-evaluation-harness tasks on our engine: each model served on 127.0.0.1 (the ``fp4moe serve`` app, its
engine on a thread) and scored by lm-eval's own ``local-completions`` client, unmodified -- the path users
take and CI checks against transformers -- then the two models' metrics side by side with lm-eval's stderr.
"""

from __future__ import annotations

import json
from pathlib import Path

from fp4moe.engine.front.config import EngineConfig


def run_tasks(
    model: str | Path,
    config: EngineConfig,
    tasks: list[str],
    include_path: str | None = None,
    limit: int | float | None = None,
    num_fewshot: int | None = None,
    batch_size: int = 8,
    log_samples: bool = False,
    serve=None,
) -> dict:
    """lm-eval's results (``simple_evaluate``) of ``tasks`` on ``model`` served by our engine: "results",
    "config" and with ``log_samples`` "samples" (per task, each document's scored requests). ``serve(model,
    config)``: a context manager serving it -> (the ``/v1/completions`` URL, its context); the default is
    ``fp4moe.server.in_process.served`` (passed in: the server sits above this package)."""
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise RuntimeError("lm-eval tasks need lm-evaluation-harness: pip install 'lm-eval[api]'") from None
    if serve is None:
        raise ValueError("run_tasks needs serve= (fp4moe.server.in_process.served)")
    with serve(model, config) as (url, max_model_len):
        model_args = {
            "model": Path(model).name,
            "base_url": url,
            "tokenizer_backend": "huggingface",
            "tokenizer": str(model),
            "num_concurrent": 1,
            "max_retries": 1,
            "max_length": max_model_len,
            "tokenized_requests": True,
        }
        results = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=model_args,
            tasks=tasks,
            task_manager=TaskManager(include_path=include_path),
            limit=limit,
            num_fewshot=num_fewshot,
            batch_size=batch_size,
            log_samples=log_samples,
        )
    out = {k: json.loads(json.dumps(results.get(k, {}), default=str)) for k in ("results", "config")}
    if log_samples:
        out["samples"] = json.loads(json.dumps(results["samples"], default=str))
    return out


def metrics(results: dict) -> dict[tuple[str, str], tuple[float, float | None]]:
    """(task, metric[,filter]) -> (value, stderr or None) of lm-eval's results."""
    out = {}
    for task, scores in results["results"].items():
        for key, value in scores.items():
            if "," not in key or "_stderr," in key or not isinstance(value, (int, float)):
                continue
            name, filt = key.split(",", 1)
            stderr = scores.get(f"{name}_stderr,{filt}")
            metric = name if filt == "none" else f"{name},{filt}"
            out[(task, metric)] = (float(value), float(stderr) if isinstance(stderr, (int, float)) else None)
    return out


def side_by_side(reference: dict, model: dict, names: tuple[str, str] = ("reference", "model")) -> str:
    """A markdown table of two results dicts: each metric of each task, both values ± stderr, the delta."""

    def cell(v: tuple[float, float | None] | None) -> str:
        if v is None:
            return "-"
        return f"{v[0]:.4f}" + (f" ± {v[1]:.4f}" if v[1] is not None else "")

    ref, mod = metrics(reference), metrics(model)
    lines = [
        f"| task | metric | {names[0]} | {names[1]} | Δ |",
        "|---|---|---|---|---|",
    ]
    for key in sorted(ref.keys() | mod.keys()):
        a, b = ref.get(key), mod.get(key)
        delta = f"{b[0] - a[0]:+.4f}" if a is not None and b is not None else "-"
        lines.append(f"| {key[0]} | {key[1]} | {cell(a)} | {cell(b)} | {delta} |")
    return "\n".join(lines)
