"""fp4moe eval on tiny models: a model against itself has KL 0 and full agreement; a perturbed copy has a
positive KL that grows with the perturbation; an NVFP4 quantization sits in between; the CLI writes a table
and JSON and refuses a reference with another tokenizer."""

import json

import pytest
import torch

from fixtures import load_all, rewrite_tensors
from fp4moe.cli import main
from fp4moe.eval.quality import evaluate

LIMIT, SEQ = 192, 64


@pytest.fixture(scope="module")
def perturbed(checkpoints):
    """Copies of the bf16 model with Gaussian noise of relative size 1% and 5% on every routed expert."""
    src = checkpoints.bf16()
    out = {}
    for level in (0.01, 0.05):
        path = checkpoints.copy(src, f"noise{level}")
        tensors = load_all(path)
        gen = torch.Generator().manual_seed(0)
        for name, t in tensors.items():
            if "mlp.experts" in name and t.is_floating_point():
                noise = torch.randn(t.shape, generator=gen) * t.float().std() * level
                tensors[name] = (t.float() + noise).to(t.dtype)
        rewrite_tensors(path, tensors)
        out[level] = path
    return out


def test_a_model_against_itself_has_zero_kl(checkpoints):
    path = checkpoints.bf16()
    r = evaluate(path, path, seq_len=SEQ, limit=LIMIT, progress=False)
    assert r.kl_mean == 0 and r.kl_max == 0 and r.top1_agreement == 1.0
    assert r.model_scores.perplexity == r.reference_scores.perplexity > 1
    assert r.tokens == LIMIT // SEQ * SEQ and r.windows == LIMIT // SEQ
    assert 0 <= r.model_scores.mtp_acceptance <= 1  # the tiny model has an MTP head


def test_kl_grows_with_the_perturbation(checkpoints, perturbed):
    ref = checkpoints.bf16()
    small = evaluate(perturbed[0.01], ref, seq_len=SEQ, limit=LIMIT, progress=False)
    large = evaluate(perturbed[0.05], ref, seq_len=SEQ, limit=LIMIT, progress=False)
    assert 0 < small.kl_mean < large.kl_mean
    assert small.kl_p99 < large.kl_p99 and small.top1_agreement >= large.top1_agreement
    nvfp4 = evaluate(checkpoints.quantized(), ref, seq_len=SEQ, limit=LIMIT, progress=False)
    assert nvfp4.kl_mean > 0 and nvfp4.top1_agreement < 1


def test_cli_writes_a_table_and_json(checkpoints, tmp_path, capsys):
    out = tmp_path / "eval.json"
    rc = main(["eval", str(checkpoints.quantized()), "--ref", str(checkpoints.bf16()), "--seq-len", "32",
               "--limit", "64", "--json", str(out)])  # fmt: skip
    assert rc == 0
    printed = capsys.readouterr().out
    assert "KL(ref‖model)" in printed and "MTP acceptance" in printed
    data = json.loads(out.read_text())
    assert data["tokens"] == 64 and data["kl_mean"] > 0


def test_cli_refuses_another_tokenizer(checkpoints, tmp_path, capsys):
    other = checkpoints.copy(checkpoints.bf16(), "othertok")
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    first = next(iter(vocab))
    vocab[first + "x"] = vocab.pop(first)
    (other / "tokenizer.json").write_text(json.dumps(tok))
    rc = main(["eval", str(other), "--ref", str(checkpoints.bf16()), "--limit", "64", "--seq-len", "32"])
    assert rc == 2 and "different tokenizers" in capsys.readouterr().err
