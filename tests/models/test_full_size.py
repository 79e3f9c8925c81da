"""The full-size Qwen3.5/3.6-35B-A3B without weights: its config, sizes, synthetic tokenizer, and the dummy
load through the CLI (shrunk with --hf-overrides so the CPU can run it)."""

import json

import pytest
import torch

from fp4moe.cli import main
from fp4moe.engine.loading.dummy import dummy_model
from fp4moe.layers.linear import Linear
from fp4moe.models import full_size
from fp4moe.models.qwen3_5_moe import ModelArgs, text_config_dict


def _bytes(module) -> int:
    return sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))


def _meta_model(name, extra=()):
    config = full_size.full_size_config(name, extra)
    return dummy_model(
        config, ModelArgs.from_text_config(text_config_dict(config)), torch.bfloat16, torch.device("meta")
    )


def test_config_has_the_released_shapes():
    from transformers import Qwen3_5MoeConfig

    config = full_size.full_size_config("qwen3.5-35b-a3b")
    assert config == full_size.full_size_config("qwen3.6-35b-a3b")  # one architecture, one set of shapes
    parsed = Qwen3_5MoeConfig.from_dict(config)
    text = parsed.text_config
    assert (text.num_hidden_layers, text.hidden_size, text.vocab_size, text.num_experts) == (
        40,
        2048,
        248320,
        256,
    )
    assert (
        text.layer_types[3::4] == ["full_attention"] * 10 and text.layer_types.count("linear_attention") == 30
    )
    assert parsed.vision_config.out_hidden_size == 2048 and parsed.vision_config.depth == 27
    assert config["text_config"]["mtp_num_hidden_layers"] == 1 and "quantization_config" not in config


def test_sizes_and_precisions():
    """bf16: 35.5 B text + MTP parameters, 71 GB; NVFP4 experts: 24.7 GB (the vision tower, 0.45 B, is not
    built by the dummy load)."""
    bf16, nvfp4 = _meta_model("qwen3.6-35b-a3b"), _meta_model("qwen3.6-35b-a3b-nvfp4")
    assert 70.5e9 < _bytes(bf16) < 71.5e9
    assert 24.2e9 < _bytes(nvfp4) < 25.2e9
    assert all(layer.mlp.experts.quantized for layer in nvfp4.layers)
    assert not nvfp4.mtp.layer.mlp.experts.quantized  # MTP stays bf16, as fp4moe quantize writes it
    linears = [m for m in nvfp4.modules() if isinstance(m, Linear)]
    assert linears and all(m.nvfp4 is None and m.fp8 is None for m in linears)
    mixed = _meta_model("qwen3.6-35b-a3b-nvfp4", ("attention", "deltanet:fp8", "shared", "lm_head"))
    assert (
        mixed.layers[3].self_attn.q_proj.nvfp4 is not None
        and mixed.layers[0].linear_attn.out_proj.fp8 is not None
    )
    assert mixed.layers[0].mlp.shared_gate_proj.nvfp4 is not None and mixed.lm_head.nvfp4 is not None
    assert _bytes(mixed) < _bytes(nvfp4)
    with pytest.raises(ValueError, match="unknown full-size model"):
        full_size.full_size_config("qwen3-235b")


def test_synthetic_tokenizer_covers_every_id():
    tok = full_size.synthetic_tokenizer()
    assert len(tok) == 248320
    assert tok.convert_tokens_to_ids(list(full_size.TOKEN_IDS)) == list(full_size.TOKEN_IDS.values())
    text = tok.decode(list(range(248320)))  # every id the model can produce decodes
    assert "<|fill_248319|>" in text
    ids = tok("def f(x): return x<|im_end|>")["input_ids"]
    assert ids[-1] == full_size.TOKEN_IDS["<|im_end|>"] and tok.decode(ids) == "def f(x): return x<|im_end|>"


def test_generate_with_a_full_size_name(tmp_path, monkeypatch, capsys):
    """The CLI path: a name -> the directory written once under the cache -> the dummy model (here shrunk to
    2 layers of width 256 and 8 experts by --hf-overrides) -> tokens."""
    monkeypatch.setenv("HOME", str(tmp_path))
    overrides = {
        "text_config": {
            "num_hidden_layers": 2,
            "layer_types": ["linear_attention", "full_attention"],
            "hidden_size": 256,
            "num_experts": 8,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 64,
        }
    }
    argv = ["generate", "qwen3.6-35b-a3b-nvfp4", "hi", "--load-format", "dummy", "--max-tokens", "3"]
    argv += ["--ignore-eos", "--temperature", "0", "--hf-overrides", json.dumps(overrides)]
    assert main(argv) == 0
    written = tmp_path / ".cache" / "fp4moe" / "full-size" / "qwen3.6-35b-a3b-nvfp4"
    assert json.loads((written / "config.json").read_text())["quantization_config"]["quant_algo"] == "NVFP4"
    assert capsys.readouterr().out.strip()


def test_the_full_size_directory_has_what_vllm_loads(tmp_path):
    """vLLM builds the model's processor at start-up (its first H200 run failed on a directory without
    preprocessor_config.json): transformers' own loaders take the tokenizer and the image processor."""
    from transformers import AutoImageProcessor, AutoTokenizer

    path = full_size.write_full_size(tmp_path / "m")
    processor = AutoImageProcessor.from_pretrained(str(path))
    assert processor.patch_size == 16 and processor.merge_size == 2
    assert processor.size["longest_edge"] == 16_777_216
    assert len(AutoTokenizer.from_pretrained(str(path))) == full_size.REAL_TEXT_CONFIG["vocab_size"]
