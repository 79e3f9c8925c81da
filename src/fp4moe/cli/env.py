"""``fp4moe env``: what this machine has (Python, torch and its CUDA, GPUs, Triton, fla, the other packages),
which engine paths and kernels will run here, and what is missing with the command that installs it -- as
``vllm collect-env`` does, for a bug report or a first check of a GPU install."""

from __future__ import annotations

import json
import os
import platform
import sys
from importlib import metadata

# (distribution, what fp4moe uses it for, how to install it)
PACKAGES = [
    ("torch", "every tensor", "see README.md, Install"),
    ("transformers", "configs, tokenizers, the vision tower, calibration's decoder layer", "pip install transformers"),
    ("safetensors", "reading and writing checkpoints", "pip install safetensors"),
    ("tokenizers", "tokenizing", "pip install tokenizers"),
    ("triton", "the GPU engine's kernels (on the CPU: their tests, interpreted)", "pip install 'fp4moe[gpu]'"),
    ("fla-core", "Gated DeltaNet prefill on the GPU (flash-linear-attention)", "pip install 'fp4moe[gpu]'"),
    ("numpy", "Triton's interpreter, bench", "pip install numpy"),
    ("fastapi", "serve", "pip install fastapi"),
    ("uvicorn", "serve", "pip install uvicorn"),
    ("httpx", "bench", "pip install httpx"),
    ("openai", "optional: a client for serve", "pip install openai"),
    ("compressed-tensors", "optional: the tests' format cross-checks", "pip install compressed-tensors"),
    ("lm-eval", "optional: eval --tasks", "pip install 'lm-eval[api]'"),
    ("datasets", "optional: quantize --calib-dataset", "pip install datasets"),
    ("vllm", "optional: serve --engine vllm --exec", "pip install vllm (on the GPU machine)"),
    ("flashinfer-python", "optional: vLLM's FlashInfer kernels", "pip install flashinfer-python"),
]
GPU_PACKAGES = {"triton", "fla-core"}


def add(sub) -> None:
    p = sub.add_parser(
        "env",
        help="what this machine has and which engine paths and kernels will run here",
        description=(
            "Report Python, torch and its CUDA, the GPUs and their compute capability, Triton, fla and the "
            "other packages fp4moe uses; which engine path (CPU reference, GPU engine) and which kernels will "
            "run here; what is missing and the command that installs it. Paste it into bug reports."
        ),
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _gpus() -> list[dict]:
    import torch

    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        out.append(
            {
                "index": i,
                "name": props.name,
                "capability": f"{props.major}.{props.minor}",
                "memory_gib": round(props.total_memory / 2**30, 1),
                "kernels": _kernels((props.major, props.minor)),
            }
        )
    return out


def _kernels(cap: tuple[int, int]) -> list[str]:
    """The GPU engine's kernel choices on a GPU of compute capability ``cap`` (``kernels.gpu_arch``)."""
    from fp4moe.kernels import gpu_arch

    if cap < gpu_arch.MIN_CAPABILITY:
        return ["none: the GPU engine needs sm80 or later (bf16 tensor cores); use --device cpu or vLLM"]
    soft = gpu_arch.SOFT_FP8 or cap < gpu_arch.FP8_CAPABILITY
    triton = _version("triton") or "0"
    gluon = tuple(int(x) for x in triton.split(".")[:2] if x.isdigit()) >= (3, 6)
    found = [
        "NVFP4 expert GEMVs and grouped GEMMs (Triton)",
        "fp8 conversions " + ("by bits (no e4m3 instructions, or FP4MOE_SOFT_FP8=1)" if soft else "in hardware"),
        "tensor-core expert GEMVs (Gluon): "
        + ("yes" if not soft and gluon else "no (needs sm89+ and Triton >= 3.6)"),
    ]
    hopper = cap >= (9, 0)
    wgmma = os.environ.get("FP4MOE_WGMMA_PREFILL", "0") == "1"
    found.append(
        "Hopper wgmma prefill GEMMs: "
        + ("on (FP4MOE_WGMMA_PREFILL=1)" if hopper and wgmma else "off (opt-in: FP4MOE_WGMMA_PREFILL=1, sm90)")
    )
    pdl = os.environ.get("FP4MOE_PDL", "2") != "0"
    found.append("programmatic dependent launch: " + ("yes" if hopper and pdl else "no (sm90+, FP4MOE_PDL)"))
    found.append("cuDNN attention for long prompts: " + ("yes" if hopper else "no (sm90+): flash attention"))
    if cap not in ((9, 0),):
        found.append("not yet run on this GPU generation: kernels compile for it (H200/H100 are the tested ones)")
    return found


def collect() -> dict:
    """The report as a dict (``--json`` prints it)."""
    import psutil
    import torch

    from fp4moe import __version__

    packages = {dist: _version(dist) for dist, _, _ in PACKAGES}
    gpus = _gpus()
    missing = []
    for dist, use, how in PACKAGES:
        needed = dist in GPU_PACKAGES and gpus or not use.startswith("optional") and dist not in GPU_PACKAGES
        if packages[dist] is None and needed:
            missing.append(f"{dist} ({use}): {how}")
    if not torch.version.cuda:
        missing.append(
            "a CUDA build of torch (this one is CPU-only): on a GPU machine, "
            "pip install --extra-index-url https://download.pytorch.org/whl/cu130 'torch==2.11.0'"
        )
    elif not gpus:
        missing.append("a visible GPU: torch has CUDA but sees none (driver, CUDA_VISIBLE_DEVICES?)")
    usable = [g for g in gpus if tuple(int(x) for x in g["capability"].split(".")) >= (8, 0)]
    gpu_engine = bool(usable) and packages["triton"] is not None
    paths = {
        "CPU reference engine (--device cpu)": "yes",
        "GPU engine (--device cuda)": "yes" if gpu_engine else "no: " + (
            "needs Triton" if usable else "needs a CUDA torch and an NVIDIA GPU of sm80 or later"
        ),
        "Gated DeltaNet prefill on the GPU": (
            "fla's chunked kernel" if packages["fla-core"] else "torch fallback (slower; pip install 'fp4moe[gpu]')"
        ) if gpu_engine else "-",
        "--device auto picks": "cuda" if gpu_engine else "cpu",
        "serve --engine vllm --exec": "yes" if packages["vllm"] else "no: vllm not installed (prints the command)",
    }  # fmt: skip
    return {
        "fp4moe": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_cores": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.version.cuda else None,
        "gpus": gpus,
        "packages": packages,
        "engine_paths": paths,
        "fp4moe_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(("FP4MOE_", "CUDA_VISIBLE"))},
        "missing": missing,
    }


def text(report: dict) -> str:
    rows = [
        ("fp4moe", report["fp4moe"]),
        ("Python", report["python"]),
        ("platform", report["platform"]),
        ("CPU cores, memory", f"{report['cpu_cores']}, {report['memory_gib']} GiB"),
        ("torch", report["torch"]),
        ("torch CUDA", report["torch_cuda"] or "none (a CPU build)"),
        ("cuDNN", report["cudnn"] or "-"),
    ]
    lines = [f"{k:<38} {v}" for k, v in rows]
    lines.append("GPUs" + (" none" if not report["gpus"] else ""))
    for g in report["gpus"]:
        lines.append(f"  {g['index']}: {g['name']}, sm{g['capability'].replace('.', '')}, {g['memory_gib']} GiB")
        lines += [f"     {k}" for k in g["kernels"]]
    lines.append("packages")
    lines += [f"  {dist:<36} {v or 'not installed'}" for dist, v in report["packages"].items()]
    lines.append("engine paths here")
    lines += [f"  {k:<36} {v}" for k, v in report["engine_paths"].items()]
    if report["fp4moe_env"]:
        lines.append("environment")
        lines += [f"  {k}={v}" for k, v in report["fp4moe_env"].items()]
    lines.append("missing" + (" nothing" if not report["missing"] else ""))
    lines += [f"  {m}" for m in report["missing"]]
    return "\n".join(lines)


def run(args) -> int:
    report = collect()
    print(json.dumps(report, indent=2) if args.json else text(report))
    return 0
