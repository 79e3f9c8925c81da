"""How quantized checkpoints are laid out (``formats/layouts.py``): the format read back from the configs our
writers produce, ModelOpt's linear tensors keyed by its suffixes, and the exclude list built from the
architecture's routed-expert predicate. Pure functions: exact checks."""

from __future__ import annotations

import json

import pytest
import torch

from fp4moe.formats import layouts
from fp4moe.formats.layouts import SUFFIXES, OutputFormat, detect_format


@pytest.mark.parametrize("fmt", list(OutputFormat))
def test_detect_format_reads_back_what_the_writers_write(fmt):
    exclude = ["lm_head", "model.language_model.layers.0.self_attn.q_proj"]
    if fmt is OutputFormat.MODELOPT:
        qc = layouts.modelopt_quantization_config(exclude, "FP8")
    else:
        qc = layouts.compressed_tensors_quantization_config(exclude, ["Linear"])
    got, entries, problem = detect_format({"quantization_config": qc})
    assert (got, problem) == (fmt, None)
    assert entries == exclude


def test_detect_format_from_hf_quant_config_alone(tmp_path):
    """ModelOpt's exporter may leave config.json without a quantization_config: hf_quant_config.json beside it
    says NVFP4."""
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(layouts.hf_quant_config(["lm_head"])))
    assert detect_format({}, tmp_path) == (OutputFormat.MODELOPT, ["lm_head"], None)


@pytest.mark.parametrize(
    "qc, problem",
    [
        (None, "no quantization_config"),
        ({"quant_method": "modelopt", "quant_algo": "FP8"}, "not NVFP4"),
        ({"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION"}, "no quantized_layers"),
        ({"quant_method": "compressed-tensors", "format": "float-quantized"}, "not nvfp4-pack-quantized"),
        ({"quant_method": "gptq"}, "neither modelopt nor compressed-tensors"),
    ],
)
def test_detect_format_names_what_is_wrong(qc, problem):
    fmt, entries, message = detect_format({} if qc is None else {"quantization_config": qc})
    assert fmt is None and entries == [] and problem in message


def test_modelopt_linear_is_keyed_by_its_suffixes_with_0d_scalars():
    packed, scales = torch.zeros(4, 8, dtype=torch.uint8), torch.ones(4, 1)
    tensors = layouts.modelopt_linear(packed, scales, torch.tensor([0.5]), torch.tensor(2.0))
    assert tuple(tensors) == SUFFIXES[OutputFormat.MODELOPT]
    assert tensors["weight"] is packed and tensors["weight_scale"] is scales
    assert tensors["weight_scale_2"].shape == () and tensors["input_scale"].shape == ()


@pytest.mark.parametrize("fmt", list(OutputFormat))
def test_excluded_modules_follow_the_predicate_given(fmt):
    """Every >= 2-D float ``weight`` the predicate does not call a routed expert is listed by its module name;
    quantized (uint8) weights, 1-D tensors, tensors not named ``weight`` and the predicate's experts are not; the MTP block's experts are
    one module entry (ModelOpt) or covered by compressed-tensors' ``re:^mtp`` entry."""
    tensors = {
        "model.layers.0.self_attn.q_proj.weight": ("BF16", (8, 8)),
        "model.layers.0.mlp.experts.gate_up_proj": ("BF16", (2, 8, 8)),
        "model.layers.0.mlp.special.weight": ("BF16", (8, 8)),
        "model.layers.0.mlp.gate.weight": ("F32", (4, 8)),
        "model.layers.0.input_layernorm.weight": ("BF16", (8,)),
        "model.layers.0.mlp.shared_expert.up_proj.weight": ("U8", (8, 4)),
        "mtp.layers.0.mlp.experts.0.up_proj.weight": ("BF16", (8, 8)),
        "lm_head.weight": ("BF16", (16, 8)),
    }
    entries = layouts.excluded_modules(tensors, fmt, lambda name: ".mlp.special." in name)
    listed = ["lm_head", "model.layers.0.mlp.gate", "model.layers.0.self_attn.q_proj"]
    if fmt is OutputFormat.MODELOPT:
        assert entries == sorted([*listed, "mtp.layers.0.mlp.experts"])
    else:
        assert entries == [*sorted(listed), r"re:^mtp\..*", r"re:.*lm_head$"]
