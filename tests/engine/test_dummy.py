"""--load-format dummy: the model from config.json alone has every tensor the real load gives, in the same
shape, dtype and device -- NVFP4, FP8 and bf16 where the checkpoint has them -- and runs."""

import pytest
import torch

from fp4moe.engine.front.llm import LLM
from fp4moe.engine.loading.loader import load_model
from fp4moe.engine.request.sampler import SamplingParams


def _layout(model) -> dict[str, tuple]:
    return {
        name: (tuple(t.shape), t.dtype, t.device.type)
        for name, t in list(model.named_parameters()) + list(model.named_buffers())
    }


@pytest.mark.parametrize(
    ("fmt", "options"),
    [
        (None, {}),
        ("modelopt", {}),
        ("compressed-tensors", {}),
        ("modelopt", {"quantize_extra": "attention,deltanet:fp8,shared,lm_head"}),
        ("compressed-tensors", {"quantize_extra": "attention,deltanet,shared"}),
    ],
    ids=["bf16", "modelopt", "compressed-tensors", "modelopt-mixed", "ct-extra"],
)
def test_dummy_matches_the_real_load(checkpoints, tmp_path, fmt, options):
    path = checkpoints.bf16() if fmt is None else checkpoints.quantized(fmt=fmt, **options)
    real, _ = load_model(path, dtype="bfloat16")
    # only config.json (and hf_quant_config.json) travel: no shard is read
    (tmp_path / "config.json").write_bytes((path / "config.json").read_bytes())
    if (path / "hf_quant_config.json").exists():
        (tmp_path / "hf_quant_config.json").write_bytes((path / "hf_quant_config.json").read_bytes())
    dummy, _ = load_model(tmp_path, load_format="dummy")
    got, want = _layout(dummy), _layout(real)
    assert got.keys() == want.keys(), (
        sorted(got.keys() - want.keys())[:5],
        sorted(want.keys() - got.keys())[:5],
    )
    differ = {k: (got[k], want[k]) for k in want if got[k] != want[k]}
    assert not differ, list(differ.items())[:5]
    kinds = {dt for _, dt, _ in got.values()}
    if fmt is not None:
        assert torch.uint8 in kinds  # NVFP4 codes
    if "fp8" in options.get("quantize_extra", ""):
        assert any("fp8.weight" in k for k in got)
    assert (dummy.mtp is None) == (real.mtp is None)


def test_dummy_llm_generates(checkpoints, tmp_path):
    path = checkpoints.quantized()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (path / name).exists():
            (tmp_path / name).write_bytes((path / name).read_bytes())
    llm = LLM(tmp_path, load_format="dummy", dtype="float32")
    out = llm.generate(["hello"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="load_format"):
        load_model(tmp_path, load_format="pickle")
