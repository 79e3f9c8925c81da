"""lm-evaluation-harness, unmodified, scores ``fp4moe serve`` of the tiny model through ``local-completions``
(loglikelihood, loglikelihood_rolling, generate_until) and ``local-chat-completions`` (generate_until), on
the offline task set in lm_eval_tasks/ (jsonl data, ``--include_path``).

What lm-eval reports must be the model's: each (context, continuation) loglikelihood equals transformers'
fp32 forward on the same tokens within 1e-4 (a sum of a few token logprobs, each within ~1e-6 of
transformers': measured worst 3.8e-6 here), and each document's rolling loglikelihood equals ``fp4moe
eval``'s perplexity on the same tokens (lm-eval scores every token after its prefix token, the EOS: the same
as ``fp4moe eval`` on EOS + the text, which scores every token after the first) within 1e-5 relative."""

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

TASKS = Path(__file__).parent / "lm_eval_tasks"
ATOL = 1e-4

pytest.importorskip("lm_eval")


@pytest.fixture(scope="module")
def served(checkpoints):
    """``fp4moe serve`` of the tiny checkpoint (fp32 on the CPU) in its own process -> (root URL, path)."""
    path = checkpoints.bf16()
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "fp4moe.cli", "serve", str(path), "--port", str(port), "--dtype", "float32"]
    cmd += ["--device", "cpu", "--served-model-name", "tiny"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    root = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{root}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline and proc.poll() is None, "server did not start"
        time.sleep(0.2)
    yield root, path
    proc.kill()
    proc.wait(10)


def _lm_eval(out: Path, model: str, model_args: dict, tasks: str, *extra: str) -> tuple[dict, dict]:
    """Run lm-eval's CLI; print its output; -> (results, {task: samples})."""
    args = ",".join(f"{k}={v}" for k, v in model_args.items())
    cmd = [sys.executable, "-m", "lm_eval", "--model", model, "--model_args", args, "--tasks", tasks]
    cmd += ["--include_path", str(TASKS), "--output_path", str(out), "--log_samples", *extra]
    env = {
        **os.environ,
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(out / "ds"),
    }
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    print(run.stdout)
    assert run.returncode == 0, run.stderr[-4000:]
    results = json.loads(next(out.rglob("results_*.json")).read_text())
    samples = {}
    for f in out.rglob("samples_*.jsonl"):
        task = f.name.removeprefix("samples_").rsplit("_", 1)[0]
        samples[task] = [json.loads(line) for line in f.read_text().splitlines()]
    return results, samples


@pytest.fixture(scope="module")
def reference(served):
    from transformers import AutoTokenizer

    from fixtures import transformers_reference

    path = served[1]
    return transformers_reference(path), AutoTokenizer.from_pretrained(str(path))


@torch.no_grad()
def _loglikelihood(model, context: list[int], continuation: list[int]) -> float:
    ids = torch.tensor([context + continuation])
    logprobs = model(input_ids=ids).logits[0, :-1].float().log_softmax(-1)
    targets = ids[0, 1:]
    chosen = logprobs.gather(1, targets[:, None])[:, 0]
    return float(chosen[len(context) - 1 :].sum())


def _encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """The tokens lm-eval scores (its documented rule: trailing spaces of the context move to the
    continuation; the context's own ids, then the ids of context + continuation past the context's count)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tok(context + continuation, add_special_tokens=False)["input_ids"]
    ctx = tok(context, add_special_tokens=False)["input_ids"]
    return ctx, whole[len(ctx) :]


def test_local_completions_scores_are_the_models(served, reference, tmp_path):
    from fp4moe.eval.quality import evaluate

    root, path = served
    model_args = {
        "model": "tiny",
        "base_url": f"{root}/v1/completions",
        "tokenizer_backend": "huggingface",
        "tokenizer": path,
        "max_retries": 1,
    }
    results, samples = _lm_eval(
        tmp_path, "local-completions", model_args, "fp4moe_mc,fp4moe_rolling,fp4moe_gen", "--batch_size", "4"
    )
    scores = results["results"]
    assert 0 <= scores["fp4moe_mc"]["acc,none"] <= 1 and scores["fp4moe_mc"]["acc_stderr,none"] >= 0
    assert scores["fp4moe_rolling"]["word_perplexity,none"] > 1
    assert len(samples["fp4moe_gen"]) == 4 and "exact_match,none" in scores["fp4moe_gen"]

    model, tok = reference
    worst = 0.0
    for sample in samples["fp4moe_mc"]:
        for args, resp in zip(sample["arguments"].values(), sample["resps"], strict=True):
            context, continuation = _encode_pair(tok, args["arg_0"], args["arg_1"])
            ours, theirs = float(resp[0][0]), _loglikelihood(model, context, continuation)
            assert ours == pytest.approx(theirs, abs=ATOL)
            worst = max(worst, abs(ours - theirs))
    print(f"worst |lm-eval via fp4moe serve - transformers| loglikelihood: {worst:.2e}")

    eos = tok.eos_token
    for sample in samples["fp4moe_rolling"]:
        text = sample["doc"]["text"]
        num_tokens = len(tok(text, add_special_tokens=False)["input_ids"])
        lm_eval_ppl = math.exp(-float(sample["resps"][0][0]) / num_tokens)
        ours = evaluate(path, path, eos + text, seq_len=num_tokens + 1, limit=num_tokens + 1, dtype="float32")
        assert ours.windows == 1 and ours.tokens == num_tokens + 1
        assert lm_eval_ppl == pytest.approx(ours.model_scores.perplexity, rel=1e-5)


def test_local_chat_completions_generates(served, tmp_path):
    root, path = served
    model_args = {"model": "tiny", "base_url": f"{root}/v1/chat/completions", "max_retries": 1}
    model_args |= {"tokenizer_backend": "huggingface", "tokenizer": path}
    results, samples = _lm_eval(
        tmp_path, "local-chat-completions", model_args, "fp4moe_gen", "--apply_chat_template"
    )
    assert "exact_match,none" in results["results"]["fp4moe_gen"]
    assert len(samples["fp4moe_gen"]) == 4 and all(
        isinstance(s["resps"][0][0], str) for s in samples["fp4moe_gen"]
    )


def test_fp4moe_eval_tasks_puts_bf16_and_nvfp4_side_by_side(checkpoints, tmp_path, monkeypatch, capsys):
    from fp4moe.cli import main

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "ds"))
    bf16, nvfp4 = checkpoints.bf16(), checkpoints.quantized()
    args = ["eval", str(nvfp4), "--ref", str(bf16), "--tasks", "fp4moe_mc", "--include-path", str(TASKS)]
    assert main([*args, "--dtype", "float32", "--json", str(tmp_path / "r.json")]) == 0
    table = capsys.readouterr().out
    print(table)
    rows = {line.split("|")[2].strip(): line for line in table.splitlines() if line.startswith("| fp4moe_mc")}
    assert set(rows) == {"acc", "acc_norm"} and all(" ± " in r for r in rows.values())
    saved = json.loads((tmp_path / "r.json").read_text())
    ref, mod = (saved[k]["results"]["fp4moe_mc"]["acc,none"] for k in ("reference", "model"))
    assert f"{mod - ref:+.4f}" in rows["acc"]
