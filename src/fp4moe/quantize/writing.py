"""Writing what the pipeline quantized: a layer's routed experts as per-expert NVFP4 tensors
(``write_experts``), a fused group of linears under one global scale (``write_linear_group``), and the
checkpoint's quantization configs (``quantization_configs``), in the output format's layout."""

from __future__ import annotations

import torch

from fp4moe.formats import fp8, kv_scales, layouts, nvfp4
from fp4moe.formats.checkpoint import ShardedWriter
from fp4moe.formats.layouts import OutputFormat
from fp4moe.models import qwen3_5_moe as arch
from fp4moe.quantize.experts import QuantizedExperts, quantize_weight, to_cpu
from fp4moe.quantize.scales import ScaleMethod


def write_experts(writer: ShardedWriter, fmt: OutputFormat, experts_prefix: str, q: QuantizedExperts) -> None:
    """Per-expert NVFP4 tensors: gate/up share the global scale and input scale of the gate_up block."""
    inter = q.intermediate_size
    for e in range(q.gate_up.packed.shape[0]):
        gu = q.gate_up[e]
        parts = {
            "gate_proj": (
                type(gu)(gu.packed[:inter], gu.block_scales[:inter], gu.global_scale),
                q.gate_up_amax[e],
                q.gate_up_input_amax[e],
            ),
            "up_proj": (
                type(gu)(gu.packed[inter:], gu.block_scales[inter:], gu.global_scale),
                q.gate_up_amax[e],
                q.gate_up_input_amax[e],
            ),
            "down_proj": (q.down[e], q.down_amax[e], q.down_input_amax[e]),
        }
        for proj, (qt, w_amax, in_amax) in parts.items():
            for suffix, t in layouts.quantized_linear_tensors(fmt, qt, w_amax, in_amax).items():
                writer.add(arch.per_expert_name(experts_prefix, e, proj, suffix), t.clone())


def quantize_linear_group(
    weights: dict[str, torch.Tensor], method: ScaleMethod, device: torch.device, algo: str = "nvfp4"
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor | nvfp4.NVFP4Tensor]]:
    """A fused group of linears (module name -> weight) under one scale from their joint amax, as vLLM's fused
    modules need -> (amax, the per-tensor FP8 scale or the NVFP4 global scale, module -> FP8 codes or
    NVFP4Tensor on ``device``). What ``write_linear_group`` stores and the format search decodes."""
    amax = torch.stack([w.abs().amax().float().cpu() for w in weights.values()]).max()
    if algo == "fp8":
        scale = fp8.scale_from_amax(amax)
        return amax, scale, {module: fp8.encode(w, scale) for module, w in weights.items()}
    global_scale = nvfp4.global_scale_from_amax(amax).to(device)
    return amax, global_scale, {m: quantize_weight(w.to(device), method, m, global_scale) for m, w in weights.items()}


def write_linear_group(
    writer: ShardedWriter,
    fmt: OutputFormat,
    weights: dict[str, torch.Tensor],
    input_amax: torch.Tensor,
    method: ScaleMethod,
    device: torch.device,
    algo: str = "nvfp4",
) -> None:
    """NVFP4 (or per-tensor FP8) of a fused group of linears (module name -> weight) under one global scale
    from their joint amax and one input scale, as vLLM's fused modules need."""
    amax, scale, quantized = quantize_linear_group(weights, method, device, algo)
    for module, q in quantized.items():
        if algo == "fp8":
            writer.add(f"{module}.weight", q)
            writer.add(f"{module}.weight_scale", scale.reshape(()).clone())
            writer.add(f"{module}.input_scale", (input_amax.float() / fp8.MAX).reshape(()).clone())
            continue
        for suffix, t in layouts.quantized_linear_tensors(fmt, to_cpu(q), amax, input_amax).items():
            writer.add(f"{module}.{suffix}", t.clone())


def quantization_configs(fmt: OutputFormat, exclude: list[str], kv: str | None) -> tuple[dict, dict | None]:
    """config.json's ``quantization_config`` for ``fmt`` and, for modelopt, hf_quant_config.json's."""
    if fmt is OutputFormat.MODELOPT:
        return layouts.modelopt_quantization_config(exclude, kv), layouts.hf_quant_config(exclude, kv)
    config = layouts.compressed_tensors_quantization_config(exclude, ["Linear"])
    if kv == "FP8":
        config["kv_cache_scheme"] = kv_scales.compressed_tensors_scheme()
    return config, None
