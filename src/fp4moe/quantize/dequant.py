"""Read a per-expert NVFP4 checkpoint back as dense weights: the fused-expert state dict transformers'
``Qwen3_5MoeForConditionalGeneration`` holds, with the routed experts dequantized in the format's own
decode order. Used to measure quantization error against the bf16 model with transformers itself."""

from __future__ import annotations

from pathlib import Path

import torch

from fp4moe.formats import layouts
from fp4moe.formats.checkpoint import CheckpointReader
from fp4moe.formats.layouts import SUFFIXES, OutputFormat, detect_format
from fp4moe.models import qwen3_5_moe as arch


def dequantized_experts(
    reader: CheckpointReader, fmt: OutputFormat, experts_prefix: str, num_experts: int, dtype=torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up [E, 2I, H], down [E, H, I]) decoded from per-expert NVFP4 tensors."""
    gate_up, down = [], []
    for e in range(num_experts):
        w = {}
        for proj in arch.PROJECTIONS:
            tensors = {s: reader.get(f"{experts_prefix}{e}.{proj}.{s}") for s in SUFFIXES[fmt]}
            w[proj] = layouts.read_quantized_linear(fmt, tensors, dtype)
        gate_up.append(torch.cat([w["gate_proj"], w["up_proj"]]))
        down.append(w["down_proj"])
    return torch.stack(gate_up), torch.stack(down)


def dequantized_state_dict(path: str | Path, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Every tensor transformers loads (no ``mtp.*``), routed experts fused and dequantized."""
    cfg = arch.ModelConfig.from_dir(path)
    fmt, _, problem = detect_format(cfg.raw, Path(path))
    if problem:
        raise ValueError(f"{path}: {problem}")
    reader = CheckpointReader(path)
    prefix = arch.text_prefix(reader)
    state = {}
    dense_nvfp4 = set()  # other NVFP4 or FP8 linears (recipes that quantize more than the experts)
    for name, info in reader.infos.items():
        if name.startswith("mtp.") or arch.classify(name) is arch.Role.ROUTED_EXPERT:
            continue
        packed = SUFFIXES[fmt][0]
        if name.endswith("." + packed) and info.dtype == "U8":
            module = layouts.module_of(name)
            tensors = {s: reader.get(f"{module}.{s}") for s in SUFFIXES[fmt]}
            state[f"{module}.weight"] = layouts.read_quantized_linear(fmt, tensors, dtype)
            dense_nvfp4.update(f"{module}.{s}" for s in SUFFIXES[fmt])
        elif (
            name.endswith(".weight") and info.dtype == "F8_E4M3"
        ):  # a per-tensor FP8 linear (--quantize :fp8)
            module = layouts.module_of(name)
            scale = reader.get(f"{module}.weight_scale").float()
            state[name] = (reader.get(name).float() * scale).to(dtype)
            dense_nvfp4.update(f"{module}.{s}" for s in ("weight", "weight_scale", "input_scale"))
    for name in reader.names():
        if name.startswith("mtp.") or arch.classify(name) is arch.Role.ROUTED_EXPERT or name in dense_nvfp4:
            continue
        state[name] = reader.get(name).to(dtype)
    for i in range(cfg.text.num_layers):
        p = f"{prefix}layers.{i}.mlp.experts."
        gu, dn = dequantized_experts(reader, fmt, p, cfg.text.num_experts, dtype)
        state[f"{p}gate_up_proj"], state[f"{p}down_proj"] = gu, dn
    return state
