"""What the GPU under the kernels can do, and what they do where it cannot.

- **The floor: sm80** (Ampere: A100, RTX 30xx). The kernels multiply bf16 on tensor cores; older GPUs have
  none for bf16, so the GPU engine refuses them at start-up (``check``) rather than failing in a compiler.
- **float8-e4m3 conversions**: the NVFP4 block scales, an fp8 KV cache and FP8 weights are e4m3 bytes.
  sm89 and later (Ada, Hopper, Blackwell) convert them in hardware; Ampere has no such instruction (Triton
  refuses ``float8e4nv`` there), so on it the kernels convert by bits, exactly (``tl_helpers.e4m3_to_f16``,
  ``fp8e4m3_bytes(..., SOFT=True)``): the NVFP4 experts through dequantization mode 1, FP8 weights through
  mode 2, an fp8 cache with the kernels' ``FP8`` constexpr at ``SOFT`` instead of True. ``FP4MOE_SOFT_FP8=1``
  takes those paths on any GPU (to check them on a newer one); the GPU tests run them that way.
- **Shared memory per program**: 227 KB on Hopper and the B200, 163 KB on the A100, 99 KB on the RTX 30xx,
  Ada and consumer Blackwell (RTX 50xx, the DGX Spark's GB10). The expert GEMM's pipeline stages are cut to what
  the GPU has (``fit_stages``); the tiles were chosen on the H200, where nothing is cut.

Compiled on the CPU for sm80, sm86, sm89 and sm120 (tests/kernels/test_gpu_arch.py: every variant the
engine records on the H200, with each GPU's settings, within its shared memory); run and measured only on the
H200."""

from __future__ import annotations

import functools
import os

import torch

from fp4moe.errors import UserError

MIN_CAPABILITY = (8, 0)
FP8_CAPABILITY = (8, 9)
SOFT = 2  # the attention kernels' FP8 constexpr for an fp8 cache converted by bits (True: by the hardware)
SOFT_FP8 = os.environ.get("FP4MOE_SOFT_FP8", "0") == "1"


@functools.cache
def capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _capability(device: torch.device) -> tuple[int, int] | None:
    """The compute capability of a CUDA device; None for the CPU (Triton's interpreter)."""
    if device.type != "cuda":
        return None
    return capability(device.index if device.index is not None else torch.cuda.current_device())


def require_device(device: str | torch.device) -> None:
    """Raise a one-line ``UserError`` where ``device`` (``--device``) cannot run here: CUDA asked of a torch
    without it, or an index past the GPUs torch sees."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    if not torch.cuda.is_available():
        build = f"torch {torch.__version__}" + ("" if torch.version.cuda else ", a build without CUDA")
        raise UserError(
            f"--device {device}: no CUDA GPU here ({build}); use --device cpu, or on a GPU machine install a "
            "CUDA build of torch (README.md, Install); `fp4moe env` shows what this machine has"
        )
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise UserError(
            f"--device {device}: torch sees {torch.cuda.device_count()} GPU(s), numbered from 0; "
            "`fp4moe env` lists them"
        )


def check(device: torch.device) -> None:
    """Raise a clear error where the GPU engine cannot run: a CUDA device older than sm80."""
    cap = _capability(device)
    if cap is not None and cap < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise RuntimeError(
            f"fp4moe's GPU engine needs an NVIDIA GPU of compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} "
            f"or later (bf16 tensor cores: A100, RTX 30xx and newer); {device} is {name} "
            f"({cap[0]}.{cap[1]}). Run it with --device cpu, or serve it with vLLM (fp4moe serve --engine vllm)."
        )


def has_fp8(device: torch.device) -> bool:
    """Whether the kernels convert e4m3 with the hardware's instructions on ``device`` (sm89+; Triton's
    interpreter emulates them) rather than by bits."""
    if SOFT_FP8:
        return False
    cap = _capability(device)
    return cap is None or cap >= FP8_CAPABILITY


def fp8_flag(device: torch.device):
    """The attention kernels' ``FP8`` constexpr for an fp8 cache on ``device``: True, or ``SOFT``."""
    return True if has_fp8(device) else SOFT


@functools.cache
def _max_shared(index: int) -> int:
    import triton

    return int(triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"])


def max_shared(device: torch.device) -> int | None:
    """Shared memory one program may use on ``device``, in bytes (the opt-in limit Triton checks at launch);
    None under the interpreter."""
    if device.type != "cuda":
        return None
    return _max_shared(device.index if device.index is not None else torch.cuda.current_device())


def fit_stages(stages: int, stage_bytes: int, limit: int | None) -> int:
    """Pipeline stages for a loop whose stage buffers take ``stage_bytes`` each, within ``limit`` bytes:
    Triton's pipeliner keeps ``stages - 1`` of them in shared memory (sm90: a bf16 gate/up tile of 16 x 256
    activations and 2 x 64 x 256 weights, 72 KB a stage, took 144 KB at 3 stages). At least 1."""
    if limit is None:
        return stages
    while stages > 2 and (stages - 1) * stage_bytes > limit:
        stages -= 1
    return stages if stage_bytes <= limit else 1
