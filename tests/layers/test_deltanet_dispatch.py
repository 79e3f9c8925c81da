"""Which Gated DeltaNet rule runs where: fla's chunked kernels only for bf16 (or fp16) values on the GPU. An fp32
model on the GPU is the parity mode, held to transformers' fp32 forward within 1e-4
(tests/server/test_completion_prompts.py): fla multiplies fp32 in TF32 (~1e-3 relative), which failed that bound
on an H200, so fp32 takes our own fp32 rule. The CPU never runs fla, so the choice itself is tested here."""

from types import SimpleNamespace

import pytest
import torch

from fp4moe.layers import deltanet


@pytest.mark.parametrize(
    "is_cuda, dtype, fla",
    [(True, torch.bfloat16, True), (True, torch.float16, True), (True, torch.float32, False),
     (False, torch.bfloat16, False), (False, torch.float32, False)],
)  # fmt: skip
def test_fla_runs_for_half_precision_values_on_the_gpu_only(monkeypatch, is_cuda, dtype, fla):
    monkeypatch.setattr(deltanet, "_fla_chunk", lambda: object())  # as if fla-core were installed
    assert deltanet._fla_runs(SimpleNamespace(is_cuda=is_cuda, dtype=dtype)) is fla


def test_without_fla_the_gpu_takes_our_rule(monkeypatch):
    monkeypatch.setattr(deltanet, "_fla_chunk", lambda: None)
    assert not deltanet._fla_runs(SimpleNamespace(is_cuda=True, dtype=torch.bfloat16))
