"""fp4moe inspect: a good checkpoint passes; each planted defect is caught, one test per defect."""

import json

import pytest
import torch

from fixtures import load_all, rewrite_tensors
from fp4moe.cli import main
from fp4moe.formats.checkpoint import CheckpointReader
from fp4moe.quantize import source_compare
from fp4moe.quantize.inspect import inspect_checkpoint

E = "model.language_model.layers.1.mlp.experts.3."
MIXED = "attention,shared,deltanet:fp8,lm_head"  # NVFP4 and FP8 linears beside the routed experts


@pytest.fixture
def good(checkpoints):
    return checkpoints.copy(checkpoints.quantized(), "inspect")


def _plant(path, edit):
    tensors = load_all(path)
    edit(tensors)
    rewrite_tensors(path, tensors)
    return inspect_checkpoint(path)


def _config(path, edit):
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg)
    (path / "config.json").write_text(json.dumps(cfg))
    return inspect_checkpoint(path)


def _assert_problem(report, fragment):
    assert not report.ok
    assert any(fragment in p for p in report.problems), report.problems


def _flip_bytes(path, name, byte_indices):
    """Flip the lowest bit of the given bytes of ``name``'s data in place in its shard (nothing else moves)."""
    info = CheckpointReader(path).info(name)
    with open(path / info.file, "r+b") as f:
        for i in byte_indices:
            assert 0 <= i < info.length
            f.seek(info.offset + i)
            byte = f.read(1)[0]
            f.seek(info.offset + i)
            f.write(bytes([byte ^ 1]))
    return info


def test_good_checkpoint_passes_with_numbers(checkpoints, good):
    report = inspect_checkpoint(good, reference=CheckpointReader(checkpoints.bf16()))
    assert report.ok, report.problems
    assert report.experts_quantized == 32 and report.experts_bf16 == 0 and report.mtp_tensors > 0
    assert 0 < report.bytes_on_disk < report.bytes_bf16_equivalent
    assert json.loads(report.to_json())["ok"] is True


def test_compressed_tensors_checkpoint_passes(checkpoints):
    assert inspect_checkpoint(checkpoints.quantized(fmt="compressed-tensors")).ok


@pytest.mark.parametrize(
    "fmt,options",
    [("modelopt", {}), ("modelopt", {"quantize_extra": MIXED}), ("compressed-tensors", {})],
    ids=["default", "mixed", "compressed-tensors"],
)
def test_reference_check_passes_for_what_the_quantizer_writes(checkpoints, fmt, options):
    """Every tensor the quantizer keeps (bf16 linears, norms, vision, MTP copied verbatim) is byte-identical to
    the source; the quantized experts and --quantize linears (NVFP4, FP8) are recognised as such."""
    report = inspect_checkpoint(
        checkpoints.quantized(fmt=fmt, **options), reference=CheckpointReader(checkpoints.bf16())
    )
    assert report.ok, report.problems


@pytest.mark.parametrize(
    "name",
    [
        "model.language_model.embed_tokens.weight",
        "model.language_model.layers.0.input_layernorm.weight",
        "model.language_model.layers.0.linear_attn.in_proj_z.weight",  # a bf16 linear
        "model.visual.blocks.0.attn.qkv.weight",
        "mtp.fc.weight",
        "mtp.layers.0.mlp.experts.5.down_proj.weight",  # MTP experts are copied verbatim, not quantized
    ],
)
def test_changed_value_against_reference(checkpoints, good, name):
    info = _flip_bytes(good, name, [2 * 7])  # the low byte (mantissa) of bf16 element 7
    assert inspect_checkpoint(good).ok  # still a sound checkpoint on its own ...
    report = inspect_checkpoint(good, reference=CheckpointReader(checkpoints.bf16()))
    numel = info.length // 2
    _assert_problem(  # ... but one value differs from the source
        report,
        f"{name} is not quantized, but 1 of {numel} elements differ from the source (1 differing bytes, "
        "the first at flat index 7)",
    )
    assert len(report.problems) == 1, report.problems


def test_changed_values_are_counted_across_chunks(checkpoints, good, monkeypatch):
    monkeypatch.setattr(source_compare, "COMPARE_CHUNK_BYTES", 64)  # 32 bf16 values a read
    name = "model.language_model.embed_tokens.weight"
    last = 1024 * 64 * 2 - 1  # the high byte of the last value
    _flip_bytes(good, name, [2 * 40, 2 * 1000, 2 * 1000 + 1, last])
    report = inspect_checkpoint(good, reference=CheckpointReader(checkpoints.bf16()))
    _assert_problem(
        report,
        f"{name} is not quantized, but 3 of 65536 elements differ from the source (4 differing bytes, "
        "the first at flat index 40)",
    )


def test_changed_value_against_reference_in_a_mixed_checkpoint(checkpoints):
    path = checkpoints.copy(checkpoints.quantized(quantize_extra=MIXED), "mixed-changed")
    # in_proj_b stays bf16 under --quantize deltanet (in the mix as FP8 here)
    name = "model.language_model.layers.0.linear_attn.in_proj_b.weight"
    _flip_bytes(path, name, [0])
    report = inspect_checkpoint(path, reference=CheckpointReader(checkpoints.bf16()))
    _assert_problem(report, f"{name} is not quantized, but 1 of 256 elements differ from the source")
    assert len(report.problems) == 1, report.problems


def test_missing_scale(good):
    _assert_problem(
        _plant(good, lambda t: t.pop(E + "up_proj.input_scale")), f"{E}up_proj.input_scale is missing"
    )


def test_nan_global_scale(good):
    def edit(t):
        t[E + "down_proj.weight_scale_2"] = torch.tensor(float("nan"))

    _assert_problem(_plant(good, edit), "not finite and positive")


def test_zero_block_scale(good):
    def edit(t):
        s = t[E + "gate_proj.weight_scale"].float()
        s[0, 0] = 0
        t[E + "gate_proj.weight_scale"] = s.to(torch.float8_e4m3fn)

    _assert_problem(_plant(good, edit), "1 block scales are not finite and positive")


def test_gate_up_scales_differ(good):
    def edit(t):
        t[E + "up_proj.weight_scale_2"] = t[E + "up_proj.weight_scale_2"] * 2

    _assert_problem(_plant(good, edit), "gate and up global scales differ")


def test_wrong_dtype(good):
    def edit(t):
        t[E + "gate_proj.weight_scale"] = t[E + "gate_proj.weight_scale"].float()

    _assert_problem(_plant(good, edit), "expected F8_E4M3")


def test_wrong_shape(good):
    def edit(t):
        t[E + "down_proj.weight"] = t[E + "down_proj.weight"][:, :-1].contiguous()

    _assert_problem(_plant(good, edit), "expected (64, 16)")


def test_expert_left_in_bf16(good):
    def edit(t):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            for sfx in ("weight_scale", "weight_scale_2", "input_scale"):
                t.pop(f"{E}{proj}.{sfx}")
            n, k2 = t[f"{E}{proj}.weight"].shape
            t[f"{E}{proj}.weight"] = torch.zeros(n, k2 * 2, dtype=torch.bfloat16)

    report = _plant(good, edit)
    _assert_problem(report, "routed expert left unquantized")
    assert report.experts_bf16 == 1


def test_exclude_entry_matching_nothing(good):
    _assert_problem(
        _config(
            good,
            lambda c: c["quantization_config"]["ignore"].append("model.language_model.layers.9.mlp.gate"),
        ),
        "matches no tensor",
    )


def test_bf16_linear_not_excluded(good):
    name = "model.language_model.layers.0.linear_attn.in_proj_z"
    _assert_problem(
        _config(good, lambda c: c["quantization_config"]["ignore"].remove(name)),
        f"{name} is BF16 but not in the exclude list",
    )


def test_exclude_entry_covering_experts(good):
    _assert_problem(
        _config(good, lambda c: c["quantization_config"]["ignore"].append("*mlp*")),
        "covers the quantized routed experts",
    )


def test_mtp_declared_but_absent(good):
    _assert_problem(
        _plant(good, lambda t: [t.pop(k) for k in [k for k in t if k.startswith("mtp.")]]), "no mtp.* tensors"
    )


def test_vision_declared_but_absent(good):
    _assert_problem(
        _plant(good, lambda t: [t.pop(k) for k in [k for k in t if k.startswith("model.visual.")]]),
        "no model.visual.*",
    )


def test_hf_quant_config_missing_keys(good):
    q = json.loads((good / "hf_quant_config.json").read_text())
    del q["quantization"]["kv_cache_quant_algo"]
    (good / "hf_quant_config.json").write_text(json.dumps(q))
    _assert_problem(inspect_checkpoint(good), "lacks keys vLLM requires: kv_cache_quant_algo")


def test_not_quantized_at_all(checkpoints):
    report = inspect_checkpoint(checkpoints.bf16())
    _assert_problem(report, "no quantization_config")
    _assert_problem(report, "routed experts left unquantized")


def test_lost_tensor_against_reference(checkpoints, good):
    report = _plant(good, lambda t: t.pop("model.language_model.layers.2.linear_attn.A_log"))
    assert report.ok  # nothing in the config says A_log must exist ...
    report = inspect_checkpoint(good, reference=CheckpointReader(checkpoints.bf16()))
    _assert_problem(report, "linear_attn.A_log from the source checkpoint is missing")  # ... the source does


def test_cli_exit_codes_and_json(good, capsys):
    assert main(["inspect", str(good), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
    _plant(good, lambda t: t.pop(E + "up_proj.input_scale"))
    assert main(["inspect", str(good)]) == 1
    assert "PROBLEM" in capsys.readouterr().out


def test_cli_reference_catches_a_changed_value(checkpoints, good, capsys):
    ref = str(checkpoints.bf16())
    assert main(["inspect", str(good), "--reference", ref]) == 0
    capsys.readouterr()
    _flip_bytes(good, "model.visual.merger.norm.weight", [5])
    assert main(["inspect", str(good), "--reference", ref]) == 1
    out = capsys.readouterr().out
    assert "PROBLEM: model.visual.merger.norm.weight is not quantized, but 1 of 32 elements differ" in out


@pytest.mark.parametrize("value", [0.0, -1.0])
def test_non_positive_scalar_scales(good, value):
    def edit(t):
        t[E + "gate_proj.input_scale"] = torch.tensor(value)

    _assert_problem(_plant(good, edit), "is not finite and positive")


def test_compressed_tensors_expert_left_in_bf16(checkpoints):
    path = checkpoints.copy(checkpoints.quantized(fmt="compressed-tensors"), "ct-bf16")

    def edit(t):
        for sfx in ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"):
            t.pop(f"{E}up_proj.{sfx}")
        t[f"{E}up_proj.weight"] = torch.zeros(32, 64, dtype=torch.bfloat16)

    report = _plant(path, edit)
    _assert_problem(report, f"{E}up_proj.weight is BF16: routed expert left unquantized")


def test_exclude_entry_covering_a_quantized_linear(good):
    name = "model.language_model.layers.0.mlp.shared_expert.up_proj"

    def edit(t):
        t[name + ".weight"] = torch.zeros(32, 32, dtype=torch.uint8)
        t[name + ".weight_scale"] = torch.ones(32, 4).to(torch.float8_e4m3fn)

    _assert_problem(_plant(good, edit), f"covers {name}, whose weight is quantized")


def test_vllm_style_entries_are_understood(good):
    cfg = json.loads((good / "config.json").read_text())
    entries = cfg["quantization_config"]["ignore"]
    entries = [e for e in entries if not e.startswith("model.visual.")] + ["visual*"]
    cfg["quantization_config"]["ignore"] = cfg["quantization_config"]["exclude_modules"] = entries
    (good / "config.json").write_text(json.dumps(cfg))
    assert inspect_checkpoint(good).ok  # vLLM's own name for the vision tower covers model.visual.*


def test_modelopt_with_only_hf_quant_config(good):
    cfg = json.loads((good / "config.json").read_text())
    del cfg["quantization_config"]
    (good / "config.json").write_text(json.dumps(cfg))
    report = inspect_checkpoint(good)
    assert report.ok and report.format == "modelopt"


def test_mtp_present_but_not_declared(good):
    cfg = json.loads((good / "config.json").read_text())
    cfg["text_config"]["mtp_num_hidden_layers"] = 0
    (good / "config.json").write_text(json.dumps(cfg))
    _assert_problem(inspect_checkpoint(good), "declares no MTP layer")


def test_split_over_gpus_is_checked_when_asked(good, capsys):
    """``--tensor-parallel-size``: the tiny checkpoint (4 attention heads, 2 Gated DeltaNet key heads,
    experts of 32 intermediate rows) splits over 2 GPUs either way; over 4 its DeltaNet heads do not, nor,
    without expert parallelism, its experts (8 rows a GPU, half an NVFP4 block); over 3 nothing splits."""
    assert inspect_checkpoint(good, split=(2, False)).ok and inspect_checkpoint(good, split=(2, True)).ok
    with_ep = inspect_checkpoint(good, split=(4, True))
    assert with_ep.problems == [
        "--tensor-parallel-size 4: 2 Gated DeltaNet key heads do not split over 4 GPUs"
    ]
    _assert_problem(inspect_checkpoint(good, split=(4, False)), "block scales would not line up")
    assert main(["inspect", str(good), "--tensor-parallel-size", "3"]) == 1
    out = capsys.readouterr().out
    assert "--tensor-parallel-size 3: 4 attention heads do not split over 3 GPUs" in out


def test_modelopt_with_only_hf_quant_config_is_a_warning(good):
    report = _config(good, lambda cfg: cfg.pop("quantization_config"))
    assert report.ok
    assert any("config.json has no quantization_config: vLLM reads hf_quant_config.json" in w for w in report.warnings)


def test_packed_experts_without_any_quantization_config(good):
    (good / "hf_quant_config.json").unlink()
    report = _config(good, lambda cfg: cfg.pop("quantization_config"))
    _assert_problem(report, "packed NVFP4 (modelopt names) but config.json has no quantization_config")
    assert len(report.problems) == 1, report.problems  # one line that says it, not one per expert


def test_config_of_another_format(good):
    def edit(cfg):
        cfg["quantization_config"].update(quant_method="compressed-tensors", format="nvfp4-pack-quantized")

    report = _config(good, edit)
    _assert_problem(report, "quantization_config says compressed-tensors but the experts are stored with modelopt")
    assert len(report.problems) == 1, report.problems


def test_config_group_size_other_than_16(good):
    _assert_problem(
        _config(good, lambda cfg: cfg["quantization_config"].update(group_size=32)),
        "quantization_config group_size 32: NVFP4 blocks are 16 values",
    )


def test_config_and_hf_quant_config_disagree(good):
    q = json.loads((good / "hf_quant_config.json").read_text())
    q["quantization"]["quant_algo"] = "FP8"
    (good / "hf_quant_config.json").write_text(json.dumps(q))
    _assert_problem(inspect_checkpoint(good), "quant_algo is NVFP4 in config.json but FP8 in hf_quant_config.json")


@pytest.mark.parametrize("what", ["missing", "no-config"])
def test_cli_bad_path_is_one_line_without_a_table(good, tmp_path, capsys, what):
    from fp4moe.cli.options import EXIT_ERROR

    path = tmp_path / "nope"
    if what == "no-config":
        path = good
        (good / "config.json").unlink()
    assert main(["inspect", str(path)]) == EXIT_ERROR
    captured = capsys.readouterr()
    assert captured.out == ""  # no table
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fp4moe inspect: error: "), err
    assert ("no such directory" if what == "missing" else "no config.json") in err[0]
