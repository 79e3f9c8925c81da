"""``quantize --kv-cache-dtype fp8``: calibrated per-layer k/v scales, checked against what transformers'
own model caches, under the names vLLM's loader maps (formats.kv_scales), declared in the config."""

import json

import pytest
import torch

from fp4moe.formats import kv_scales
from fp4moe.formats.checkpoint import CheckpointReader
from fp4moe.formats.layouts import OutputFormat
from fp4moe.models import qwen3_5_moe as arch
from fp4moe.quantize.options import QuantizeOptions
from fp4moe.quantize.pipeline import calibration_token_ids

PREFIX = "model.language_model.layers."


def _oracle_kv_amax(bf16_dir, tokens) -> dict[int, tuple[float, float]]:
    """{layer: (amax of the keys, of the values)} that transformers' model hands its cache: the keys as
    ``apply_rotary_pos_emb`` returns them (after the k-norm), the values as ``v_proj`` returns them."""
    import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe as modeling
    from transformers import Qwen3_5MoeForConditionalGeneration

    model = Qwen3_5MoeForConditionalGeneration.from_pretrained(str(bf16_dir), dtype=torch.float32)
    layers = model.model.language_model.layers
    attn = [i for i, layer in enumerate(layers) if layer.block_type == "full_attention"]
    keys: list[float] = []
    values: dict[int, float] = {}
    real_rotary = modeling.apply_rotary_pos_emb

    def spy(q, k, cos, sin, *args, **kwargs):
        q, k = real_rotary(q, k, cos, sin, *args, **kwargs)
        keys.append(float(k.abs().max()))
        return q, k

    hooks = [
        layers[i].self_attn.v_proj.register_forward_hook(
            lambda m, a, out, i=i: values.__setitem__(i, float(out.abs().max()))
        )
        for i in attn
    ]
    modeling.apply_rotary_pos_emb = spy
    try:
        with torch.no_grad():
            model(input_ids=tokens)
    finally:
        modeling.apply_rotary_pos_emb = real_rotary
        for h in hooks:
            h.remove()
    assert len(keys) == len(attn), "one rotary call per full-attention layer"
    return {i: (k, values[i]) for i, k in zip(attn, keys, strict=True)}


@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
def test_kv_scales_are_the_amax_of_what_transformers_caches(checkpoints, fmt):
    src = checkpoints.bf16()
    out = checkpoints.quantized(fmt=fmt, kv_cache_quant_algo="FP8")
    options = QuantizeOptions(num_samples=8, seq_len=64)
    tokens, _ = calibration_token_ids(src, arch.ModelConfig.from_dir(src), options)
    oracle = _oracle_kv_amax(src, tokens)
    reader = CheckpointReader(out)
    found = kv_scales.find(reader.names(), arch.layer_of)
    assert sorted(found) == sorted(oracle), "a k and a v scale for every full-attention layer, no other"
    for layer, (k_amax, v_amax) in oracle.items():
        k_name, v_name = kv_scales.names(OutputFormat(fmt), f"{PREFIX}{layer}.")
        assert found[layer] == {"k": k_name, "v": v_name}
        for name, amax in ((k_name, k_amax), (v_name, v_amax)):
            stored = reader.get(name)
            assert stored.dtype == torch.float32 and stored.shape == ()
            # fp32 both sides; the layer-at-a-time forward may differ from the whole model in the last bits
            torch.testing.assert_close(stored, torch.tensor(amax / 448.0), rtol=1e-5, atol=0, msg=name)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    if fmt == "modelopt":
        assert qc["kv_cache_quant_algo"] == "FP8"
        hf = json.loads((out / "hf_quant_config.json").read_text())
        assert hf["quantization"]["kv_cache_quant_algo"] == "FP8"
    else:
        assert qc["kv_cache_scheme"] == {
            "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True
        }  # fmt: skip


def test_no_kv_scales_unless_asked(checkpoints):
    reader = CheckpointReader(checkpoints.quantized())
    assert not [n for n in reader.names() if kv_scales.is_kv_scale(n)]


def test_vllm_maps_the_names_onto_its_attention_layers():
    """vLLM 0.26's ``QuantizationConfig.get_cache_scale_mapper`` rules for these suffixes (its
    model_executor/layers/quantization/base_config.py), restated: ModelOpt's ``.self_attn.{k,v}_proj.{k,v}_scale``
    and the default ``.{k,v}_scale`` both land on ``.self_attn.attn.{k,v}_scale``."""
    import re

    rules = [
        (re.compile(r"\.self_attn\.[kv]_proj\.([kv])_scale$"), r".self_attn.attn.\1_scale"),
        (re.compile(r"(?<!\.attn)\.([qkv])_scale$"), r".attn.\1_scale"),
    ]

    def vllm_name(name):
        for pattern, repl in rules:
            if pattern.search(name):
                return pattern.sub(repl, name)
        return name

    for fmt in OutputFormat:
        k, v = kv_scales.names(fmt, f"{PREFIX}3.")
        assert vllm_name(k) == f"{PREFIX}3.self_attn.attn.k_scale"
        assert vllm_name(v) == f"{PREFIX}3.self_attn.attn.v_scale"


# ---- inspect -----------------------------------------------------------------------------------------

K3 = f"{PREFIX}3.self_attn.k_proj.k_scale"  # layer 3 is the fixture's first full-attention layer
V3 = f"{PREFIX}3.self_attn.v_proj.v_scale"


@pytest.fixture
def with_kv(checkpoints):
    return checkpoints.copy(checkpoints.quantized(kv_cache_quant_algo="FP8"), "kv")


def _problems(path, edit=None, config=None):
    from fixtures import load_all, rewrite_tensors
    from fp4moe.quantize.inspect import inspect_checkpoint

    if edit is not None:
        tensors = load_all(path)
        edit(tensors)
        rewrite_tensors(path, tensors)
    if config is not None:
        for name in ("config.json", "hf_quant_config.json"):
            f = path / name
            data = json.loads(f.read_text())
            config(name, data)
            f.write_text(json.dumps(data))
    report = inspect_checkpoint(path)
    assert report.ok or report.problems
    return report


@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
def test_inspect_passes_calibrated_kv_scales(checkpoints, fmt):
    from fp4moe.quantize.inspect import inspect_checkpoint

    report = inspect_checkpoint(checkpoints.quantized(fmt=fmt, kv_cache_quant_algo="FP8"))
    assert report.ok, report.problems
    assert report.kv_cache == "fp8, k/v scales in 1 attention layer(s)"  # the fixture's layer 3


@pytest.mark.parametrize(
    "edit, fragment",
    [
        (lambda t: t.pop(V3), f"{V3} missing"),
        (lambda t: t.__setitem__(K3, torch.tensor(-1.0)), "positive finite scalar"),
        (lambda t: t.__setitem__(K3, torch.tensor(float("nan"))), "positive finite scalar"),
        (lambda t: t.__setitem__(K3, torch.ones(2)), "positive finite scalar"),
        (lambda t: t.__setitem__(f"{PREFIX}0.self_attn.k_scale", torch.tensor(1.0)), "not a full-attention"),
        (lambda t: t.__setitem__(f"{PREFIX}3.self_attn.k_scale", t.pop(K3)), "the other format's name"),
    ],
    ids=["missing", "negative", "nan", "not-scalar", "not-attention", "other-format"],
)
def test_inspect_catches_bad_kv_scales(with_kv, edit, fragment):
    report = _problems(with_kv, edit=edit)
    assert not report.ok and any(fragment in p for p in report.problems), report.problems


def test_inspect_catches_scales_the_config_does_not_declare(with_kv):
    def undeclare(name, data):
        (data["quantization_config"] if name == "config.json" else data["quantization"])[
            "kv_cache_quant_algo"
        ] = None

    report = _problems(with_kv, config=undeclare)
    assert any("declares no fp8 KV cache" in p for p in report.problems), report.problems


def test_inspect_catches_configs_that_disagree(with_kv):
    def hf_only(name, data):
        if name == "hf_quant_config.json":
            data["quantization"]["kv_cache_quant_algo"] = None

    report = _problems(with_kv, config=hf_only)
    assert any("in hf_quant_config.json" in p for p in report.problems), report.problems


def test_inspect_catches_a_declared_cache_without_scales(checkpoints):
    """What ``--kv-cache-quant-algo FP8`` wrote before scales were calibrated: vLLM would fall back to 1.0."""
    path = checkpoints.copy(checkpoints.quantized(), "kv-declared")

    def declare(name, data):
        (data["quantization_config"] if name == "config.json" else data["quantization"])[
            "kv_cache_quant_algo"
        ] = "FP8"

    report = _problems(path, config=declare)
    assert any(f"{K3} missing" in p for p in report.problems), report.problems
