"""The model card and recipe ``quantize`` writes: Hugging Face metadata with the source's license, what is in
which precision, the calibration and fallbacks, inspect's verdict, the serve commands; the recipe in
hf_quant_config.json beside what vLLM reads, and the card's command rebuilds the same bytes;
``eval --card`` fills the quality section."""

import json
import shlex

import torch

from fixtures import load_all
from fp4moe.cli import main
from fp4moe.quantize.card import QUALITY_BEGIN, QUALITY_END, replace_quality

ARGS = ["--num-samples", "4", "--seq-len", "32", "--scale-method", "rtn", "--seed", "3", "--no-progress"]


def _quantize(src, dst, *extra) -> None:
    assert main(["quantize", str(src), str(dst), *ARGS, *extra]) == 0


def test_card_and_recipe(checkpoints, tmp_path):
    src = checkpoints.copy(checkpoints.bf16(), "card-src")
    (src / "README.md").write_text("---\nlicense: apache-2.0\nlicense_link: LICENSE\n---\n# the source's card\n")
    dst = tmp_path / "tiny-nvfp4"
    _quantize(src, dst, "--quantize", "attention:fp8", "--base-model", "Qwen/Qwen3.6-35B-A3B")
    card = (dst / "README.md").read_text()
    front = card.split("---\n")[1]
    assert "base_model: Qwen/Qwen3.6-35B-A3B\n" in front and "library_name: vllm\n" in front
    assert "license: apache-2.0\n" in front and "license_link: LICENSE\n" in front
    assert "- nvfp4\n" in front and "- fp8\n" in front and "- modelopt\n" in front
    assert "the source's card" not in card  # ours, not the copied one
    assert "Block scales: `rtn`" in card and "GPTQ: off" in card and "Mix: experts, attention:fp8" in card
    assert "128 tokens (4 sequences of 32, seed 3)" in card
    assert "fallback experts" in card and "result                               OK" in card
    assert "vllm serve tiny-nvfp4" in card and "fp4moe serve tiny-nvfp4" in card
    assert QUALITY_BEGIN in card and QUALITY_END in card

    hf = json.loads((dst / "hf_quant_config.json").read_text())
    assert hf["quantization"]["quant_algo"] == "MIXED_PRECISION"  # what vLLM reads is unchanged
    recipe = hf["fp4moe_recipe"]
    assert recipe["scale_method"] == "rtn" and recipe["gptq"] is False
    assert recipe["quantize"] == ["experts", "attention:fp8"]
    assert recipe["calibration"]["tokens"] == 128 and recipe["calibration"]["seed"] == 3

    # the card's command makes the same tensors
    command = card.split("```bash\n")[1].split("\n```")[0]
    argv = shlex.split(command)
    assert argv[:4] == ["fp4moe", "quantize", src.name, "tiny-nvfp4"]  # no path of this machine
    assert main(["quantize", str(src), str(tmp_path / "again"), *argv[4:], "--no-progress"]) == 0
    a, b = load_all(dst), load_all(tmp_path / "again")
    assert a.keys() == b.keys()
    assert all(a[k].reshape(-1).view(torch.uint8).equal(b[k].reshape(-1).view(torch.uint8)) for k in a)


def test_card_without_a_hub_id_or_license(checkpoints, tmp_path):
    dst = tmp_path / "out"
    _quantize(checkpoints.bf16(), dst, "--format", "compressed-tensors")
    card = (dst / "README.md").read_text()
    front = card.split("---\n")[1]
    assert "base_model" not in front and "license" not in front  # unknown: left out, not made up
    assert "- compressed-tensors\n" in front
    assert not (dst / "hf_quant_config.json").exists()  # compressed-tensors: vLLM must not see ModelOpt's file


def test_eval_card_writes_the_quality_table(checkpoints, tmp_path):
    model = checkpoints.copy(checkpoints.quantized(), "card-eval")
    before = (model / "README.md").read_text()
    argv = ["eval", str(model), "--ref", str(checkpoints.bf16()), "--limit", "64", "--seq-len", "32", "--card"]
    assert main(argv) == 0
    card = (model / "README.md").read_text()
    quality = card.split(QUALITY_BEGIN)[1].split(QUALITY_END)[0]
    assert "Not measured yet" not in quality and "KL(ref‖model) mean" in quality and "\n\n|" in quality
    assert str(model) not in quality and f"model {model.name} |" in quality  # names, not this machine's paths
    assert card.split(QUALITY_BEGIN)[0] == before.split(QUALITY_BEGIN)[0]  # the rest untouched
    assert main(argv) == 0  # again: replaced, not appended
    assert (model / "README.md").read_text().count(QUALITY_BEGIN) == 1


def test_replace_quality_appends_to_a_card_without_markers(tmp_path):
    card = tmp_path / "README.md"
    card.write_text("# someone's card\n")
    replace_quality(card, "| a |\n|---|\n| 1 |")
    text = card.read_text()
    assert text.startswith("# someone's card\n") and f"{QUALITY_BEGIN}\n| a |" in text
    assert not list(tmp_path.glob(".*tmp"))
