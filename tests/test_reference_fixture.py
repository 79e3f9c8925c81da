"""``fixtures.transformers_reference``: transformers' model on its own torch Gated DeltaNet, even where fla is
installed. On the GPU machine (fla among the carried wheels) transformers binds fla's CUDA-only kernels at import
and the CPU reference's forward failed ("cannot be accessed from Triton (cpu tensor?)"); here fla's binding is
stood in for by wrappers that fail the same way on CPU tensors."""

import functools

import pytest
import torch

from fixtures import _TRANSFORMERS_GDN, transformers_reference


def _as_if_fla_were_bound(fn):
    @functools.wraps(fn)  # as transformers' hub wrapper does: the torch function stays its __wrapped__
    def bound(*args, **kwargs):
        raise ValueError("Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)")

    return bound


def test_the_reference_runs_its_torch_delta_rule_where_fla_is_bound(checkpoints, monkeypatch):
    import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe as modeling

    bound = [name for name in _TRANSFORMERS_GDN if hasattr(modeling, name)]
    assert "torch_chunk_gated_delta_rule" in bound  # transformers still calls it by this name
    for name in bound:
        monkeypatch.setattr(modeling, name, _as_if_fla_were_bound(getattr(modeling, name)))
    with pytest.raises(ValueError, match="cpu tensor"):  # the stand-in fails as fla did
        modeling.torch_chunk_gated_delta_rule(None)
    model = transformers_reference(checkpoints.bf16())
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([list(range(3, 73))])).logits  # 70 tokens: the chunked rule
    assert logits.shape[1] == 70 and torch.isfinite(logits).all()
