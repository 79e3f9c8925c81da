"""fp4moe convert: the reference build's fused NVFP4 experts -> per-expert ModelOpt tensors."""

import pytest
import torch

from fixtures import load_all, rewrite_tensors
from fp4moe.formats import nvfp4
from fp4moe.formats.checkpoint import CheckpointError, CheckpointReader
from fp4moe.quantize.convert import convert, fuse_experts
from fp4moe.quantize.inspect import inspect_checkpoint


@pytest.fixture
def fused(checkpoints):
    path = checkpoints.copy(checkpoints.quantized(), "fused")
    rewrite_tensors(path, fuse_experts(load_all(path), num_layers=4, num_experts=8))
    return path


def test_fused_layout_is_flagged_by_inspect(fused):
    report = inspect_checkpoint(fused)
    assert not report.ok and report.experts_fused_nvfp4 == 32
    assert any("fp4moe convert" in p for p in report.problems)


def test_convert_round_trips_bit_for_bit(checkpoints, fused, tmp_path):
    report = convert(fused, tmp_path / "out", progress=False)
    assert report.experts_converted == 32 and report.experts_requantized == []
    original, converted = load_all(checkpoints.quantized()), load_all(tmp_path / "out")
    assert set(original) == set(converted)
    for name, t in original.items():
        assert torch.equal(t.reshape(-1).view(torch.uint8), converted[name].reshape(-1).view(torch.uint8)), (
            name
        )
    assert inspect_checkpoint(tmp_path / "out").ok


def test_convert_shares_differing_gate_up_scales(checkpoints, fused, tmp_path):
    tensors = load_all(fused)
    p = "model.language_model.layers.2.mlp.experts."
    s2 = tensors[f"{p}gate_up_proj_weight_scale_2"].clone()
    s2[5, 1] = s2[5, 1] * 0.7  # expert 5's up projection had its own, smaller scale
    tensors[f"{p}gate_up_proj_weight_scale_2"] = s2
    rewrite_tensors(fused, tensors)
    report = convert(fused, tmp_path / "out", progress=False)
    assert report.experts_requantized == [f"{p}5.up_proj"]
    out = CheckpointReader(tmp_path / "out")
    e = f"{p}5."
    assert torch.equal(out.get(e + "gate_proj.weight_scale_2"), out.get(e + "up_proj.weight_scale_2"))
    # the re-quantized up projection decodes close to what the fused checkpoint meant
    inter = tensors[f"{p}gate_up_proj"].shape[1] // 2
    meant = nvfp4.dequantize_modelopt(
        tensors[f"{p}gate_up_proj"][5, inter:], tensors[f"{p}gate_up_proj_weight_scale"][5, inter:], s2[5, 1]
    )
    got = nvfp4.dequantize_modelopt(
        out.get(e + "up_proj.weight"),
        out.get(e + "up_proj.weight_scale"),
        out.get(e + "up_proj.weight_scale_2"),
    )
    rel = (got - meant).norm() / meant.norm()
    assert 0 < rel < 0.15, rel  # one more FP4 rounding: about the error of quantizing once
    assert inspect_checkpoint(tmp_path / "out").ok


def test_convert_refuses_a_checkpoint_without_fused_experts(checkpoints, tmp_path):
    with pytest.raises(CheckpointError, match="no fused NVFP4 expert blocks"):
        convert(checkpoints.quantized(), tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
