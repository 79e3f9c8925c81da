"""--quantize beyond the routed experts: attention, Gated DeltaNet, shared experts, lm_head in NVFP4,
written so vLLM's fused modules load (one global and input scale per fused group, in_proj_b/a and routers
kept bf16), checked by inspect, loaded by our engine, and costing more KL than the experts alone."""

import json

import pytest

from fixtures import load_all, rewrite_tensors
from fp4moe.cli import main
from fp4moe.engine.front.llm import LLM
from fp4moe.engine.request.sampler import SamplingParams
from fp4moe.eval.quality import evaluate
from fp4moe.quantize.inspect import inspect_checkpoint

ALL = ("attention", "deltanet", "shared", "lm_head")
L0, L3 = "model.language_model.layers.0.", "model.language_model.layers.3."


@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
def test_extended_mix_is_sound_and_loads(checkpoints, fmt):
    path = checkpoints.quantized(fmt=fmt, quantize_extra=ALL)
    report = inspect_checkpoint(path)
    assert report.ok, report.problems
    t = load_all(path)
    packed = "weight" if fmt == "modelopt" else "weight_packed"
    glob = "weight_scale_2" if fmt == "modelopt" else "weight_global_scale"
    for m in (
        "linear_attn.in_proj_qkv",
        "linear_attn.in_proj_z",
        "linear_attn.out_proj",
        "mlp.shared_expert.up_proj",
    ):
        assert t[f"{L0}{m}.{packed}"].dtype.itemsize == 1
    for m in ("self_attn.q_proj", "self_attn.o_proj"):
        assert t[f"{L3}{m}.{packed}"].dtype.itemsize == 1
    assert t[f"lm_head.{packed}"].dtype.itemsize == 1
    for m in ("linear_attn.in_proj_b", "linear_attn.in_proj_a", "mlp.gate", "mlp.shared_expert_gate"):
        assert t[f"{L0}{m}.weight"].is_floating_point()  # stays bf16
    qkv = {float(t[f"{L3}self_attn.{p}_proj.{glob}"].reshape(-1)[0]) for p in "qkv"}
    assert len(qkv) == 1  # one global scale per vLLM-fused group
    ignore = json.loads((path / "config.json").read_text())["quantization_config"]["ignore"]
    assert f"{L0}linear_attn.in_proj_b" in ignore and f"{L0}linear_attn.in_proj_qkv" not in ignore
    assert "lm_head" not in ignore
    llm = LLM(path, dtype="float32")
    out = llm.generate(["def f(x):"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    assert llm.model.lm_head.nvfp4 is not None and llm.model.layers[3].self_attn.q_proj.nvfp4 is not None


def test_more_quantized_tensors_cost_more_kl(checkpoints):
    ref = checkpoints.bf16()
    experts = evaluate(checkpoints.quantized(), ref, seq_len=64, limit=192, progress=False)
    everything = evaluate(
        checkpoints.quantized(quantize_extra=ALL), ref, seq_len=64, limit=192, progress=False
    )
    assert 0 < experts.kl_mean < everything.kl_mean


def test_inspect_catches_mixed_and_unequal_fused_groups(checkpoints):
    src = checkpoints.quantized(quantize_extra=("attention",))
    tensors = load_all(src)
    bad_scale = checkpoints.copy(src, "fused-scale")
    t = dict(tensors)
    t[f"{L3}self_attn.v_proj.weight_scale_2"] = t[f"{L3}self_attn.v_proj.weight_scale_2"] * 2
    rewrite_tensors(bad_scale, t)
    assert any("different global scales" in p for p in inspect_checkpoint(bad_scale).problems)
    mixed = checkpoints.copy(src, "fused-mixed")
    t = {n: v for n, v in tensors.items() if not n.startswith(f"{L3}self_attn.k_proj.")}
    bf16 = load_all(checkpoints.bf16())
    t[f"{L3}self_attn.k_proj.weight"] = bf16[f"{L3}self_attn.k_proj.weight"]
    rewrite_tensors(mixed, t)
    assert any("one precision per fused module" in p for p in inspect_checkpoint(mixed).problems)


def test_unknown_group_is_a_clear_error(checkpoints, tmp_path, capsys):
    rc = main(["quantize", str(checkpoints.bf16()), str(tmp_path / "q"), "--quantize", "experts,mlp"])
    assert rc == 2 and "unknown group(s) mlp" in capsys.readouterr().err
    assert not (tmp_path / "q").exists()


def test_fp8_groups_are_written_as_modelopt_mixed_precision(checkpoints):
    path = checkpoints.quantized(quantize_extra=("attention:fp8", "shared"))
    report = inspect_checkpoint(path)
    assert report.ok, report.problems
    t = load_all(path)
    assert str(t[f"{L3}self_attn.q_proj.weight"].dtype) == "torch.float8_e4m3fn"
    assert (
        t[f"{L3}self_attn.q_proj.weight_scale"].ndim == 0 and t[f"{L3}self_attn.q_proj.input_scale"].ndim == 0
    )
    assert t[f"{L0}mlp.shared_expert.up_proj.weight"].dtype.itemsize == 1  # NVFP4 codes (uint8)
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    hf = json.loads((path / "hf_quant_config.json").read_text())["quantization"]
    assert qc["quant_algo"] == hf["quant_algo"] == "MIXED_PRECISION"
    layers = qc["quantized_layers"]
    assert layers[f"{L3}self_attn.q_proj"] == {"quant_algo": "FP8"}
    assert layers[f"{L0}mlp.experts"]["quant_algo"] == "NVFP4"
    assert layers[f"{L0}mlp.shared_expert.gate_proj"] == {"quant_algo": "NVFP4", "group_size": 16}
    assert f"{L3}self_attn.q_proj" not in qc["ignore"]
    llm = LLM(path, dtype="float32")
    assert llm.model.layers[3].self_attn.q_proj.fp8 is not None
    ref = checkpoints.bf16()
    fp8 = evaluate(path, ref, seq_len=64, limit=192, progress=False)
    fp4 = evaluate(
        checkpoints.quantized(quantize_extra=("attention", "shared")),
        ref,
        seq_len=64,
        limit=192,
        progress=False,
    )
    assert 0 < fp8.kl_mean < fp4.kl_mean  # FP8 attention costs less than NVFP4 attention


def test_fp8_needs_the_modelopt_format(checkpoints, tmp_path, capsys):
    rc = main(["quantize", str(checkpoints.bf16()), str(tmp_path / "q"), "--format", "compressed-tensors",
               "--quantize", "attention:fp8"])  # fmt: skip
    assert rc == 2 and "MIXED_PRECISION" in capsys.readouterr().err
