"""fp4moe env: what this machine has, what will run, what is missing and how to install it."""

import json

import pytest
import torch

from fp4moe.cli import env, main


@pytest.mark.skipif(torch.cuda.is_available(), reason="the report of a CPU machine")
def test_env_on_a_cpu_machine(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert f"torch                                  {torch.__version__}" in out
    assert "torch CUDA                             none (a CPU build)" in out
    assert "GPUs none" in out
    assert "GPU engine (--device cuda)           no: needs a CUDA torch" in out
    assert "--device auto picks                  cpu" in out
    assert "a CUDA build of torch (this one is CPU-only)" in out and "download.pytorch.org/whl/cu130" in out
    assert main(["env", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["torch"] == torch.__version__ and report["gpus"] == []
    assert report["packages"]["transformers"] is not None


def test_missing_packages_are_named_with_their_install(monkeypatch):
    real = env._version
    monkeypatch.setattr(env, "_version", lambda dist: None if dist in ("transformers", "vllm") else real(dist))
    report = env.collect()
    assert "transformers (configs, tokenizers, the vision tower, calibration's decoder layer): pip install " \
        "transformers" in report["missing"]
    assert not any(m.startswith("vllm") for m in report["missing"])  # optional: reported, not missing
    assert report["engine_paths"]["serve --engine vllm --exec"].startswith("no: vllm not installed")


def test_a_gpu_without_triton(monkeypatch):
    """A CUDA machine whose install lacks the gpu extra: the GPU engine cannot run, and the report says why."""
    real = env._version
    monkeypatch.setattr(env, "_version", lambda dist: None if dist in ("triton", "fla-core") else real(dist))
    gpu = {"index": 0, "name": "NVIDIA H100", "capability": "9.0", "memory_gib": 79.1, "kernels": []}
    monkeypatch.setattr(env, "_gpus", lambda: [gpu])
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91000)
    report = env.collect()
    assert report["engine_paths"]["GPU engine (--device cuda)"] == "no: needs Triton"
    assert "triton (the GPU engine's kernels (on the CPU: their tests, interpreted)): pip install 'fp4moe[gpu]'" \
        in report["missing"]
    assert any(m.startswith("fla-core") for m in report["missing"])


def test_kernels_by_compute_capability(monkeypatch):
    monkeypatch.delenv("FP4MOE_SOFT_FP8", raising=False)
    monkeypatch.setattr(env, "_version", lambda dist: "3.6.0" if dist == "triton" else None)
    assert env._kernels((7, 5))[0].startswith("none: the GPU engine needs sm80")
    ampere = env._kernels((8, 0))
    assert "fp8 conversions by bits (no e4m3 instructions, or FP4MOE_SOFT_FP8=1)" in ampere
    assert "tensor-core expert GEMVs (Gluon): no (needs sm89+ and Triton >= 3.6)" in ampere
    assert "programmatic dependent launch: no (sm90+, FP4MOE_PDL)" in ampere
    assert any(k.startswith("not yet run") for k in ampere)
    hopper = env._kernels((9, 0))
    assert "fp8 conversions in hardware" in hopper and "tensor-core expert GEMVs (Gluon): yes" in hopper
    assert "programmatic dependent launch: yes" in hopper and "cuDNN attention for long prompts: yes" in hopper
    assert not any(k.startswith("not yet run") for k in hopper)
    monkeypatch.setattr(env, "_version", lambda dist: "3.5.0" if dist == "triton" else None)
    assert "tensor-core expert GEMVs (Gluon): no (needs sm89+ and Triton >= 3.6)" in env._kernels((9, 0))
