"""NVFP4 for more than the routed experts (``--quantize``): which linears, in which fused groups, and the
calibration of their inputs.

The reference build keeps attention, Gated DeltaNet projections, shared experts and lm_head in bf16 --
about 85% of the bytes a decode step reads. Each group can be put in NVFP4 too, written so stock vLLM
loads it: vLLM fuses q/k/v (qkv_proj), in_proj_qkv + in_proj_z (in_proj_qkvz) and the shared expert's
gate + up (gate_up_proj) into one module each, requires all shards of a fused module to have the same
precision, and dequantizes a fused NVFP4 module with the largest ``weight_scale_2`` of its shards
without requantizing -- so every shard of a group gets one shared global scale (from the group's joint
amax) and one shared input scale. ``in_proj_b``/``in_proj_a`` (tiny; Marlin's N % 64 limit before vLLM 0.24),
conv1d, routers, ``shared_expert_gate``, embeddings, vision and MTP stay bf16. Needs vLLM >= 0.20 for a
quantized in_proj_qkvz and >= 0.23 for a quantized lm_head (Qwen3.5 only).

``GROUP:fp8`` puts a group in per-tensor FP8 instead (weight e4m3, fp32 weight and input scales; ModelOpt
``MIXED_PRECISION``, vLLM >= 0.17, W8A8 there; our engine runs it weight-only).
"""

from __future__ import annotations

import torch

GROUPS = {  # option -> fused groups of module names (relative to a decoder layer; lm_head: top level)
    "attention": [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.o_proj"]],
    "deltanet": [["linear_attn.in_proj_qkv", "linear_attn.in_proj_z"], ["linear_attn.out_proj"]],
    "shared": [["mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"], ["mlp.shared_expert.down_proj"]],
    "lm_head": [["lm_head"]],
}


ALGOS = ("nvfp4", "fp8")


def split(option: str) -> tuple[str, str]:
    """``attention`` -> (attention, nvfp4); ``attention:fp8`` -> (attention, fp8)."""
    name, _, algo = option.partition(":")
    return name, algo or "nvfp4"


def parse_groups(value: str | list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    """``attention,deltanet:fp8`` (or a list) -> validated options; ``experts`` (always NVFP4) is implied."""
    if not value:
        return ()
    items = value.split(",") if isinstance(value, str) else list(value)
    options = sorted({i.strip() for i in items if i.strip() and i.strip() != "experts"})
    unknown = [o for o in options if split(o)[0] not in GROUPS]
    if unknown:
        choices = ", ".join(GROUPS)
        raise ValueError(f"--quantize: unknown group(s) {', '.join(unknown)}; choose from experts, {choices}")
    bad = [o for o in options if split(o)[1] not in ALGOS]
    if bad:
        raise ValueError(f"--quantize: unknown format in {', '.join(bad)}; use GROUP or GROUP:fp8")
    names = [split(o)[0] for o in options]
    if len(set(names)) != len(names):
        raise ValueError("--quantize: a group is listed with two formats")
    return tuple(options)


def uses_fp8(options: tuple[str, ...]) -> bool:
    return any(split(o)[1] == "fp8" for o in options)


def layer_groups(options: tuple[str, ...], module_names: set[str]) -> list[tuple[list[str], str]]:
    """(fused group, algo) of one decoder layer that exist in it (attention layers have no linear_attn)."""
    out = []
    for option in options:
        name, algo = split(option)
        if name == "lm_head":
            continue
        for group in GROUPS[name]:
            if all(m in module_names for m in group):
                out.append((group, algo))
    return out


class InputAmax:
    """Forward pre-hooks recording the absolute maximum of each listed submodule's input."""

    def __init__(self, layer: torch.nn.Module, modules: list[str]):
        self.amax: dict[str, torch.Tensor] = {}
        self._handles = []
        for name in modules:
            mod = layer.get_submodule(name)
            self._handles.append(mod.register_forward_pre_hook(self._hook(name)))

    def _hook(self, name: str):
        def record(module, args):
            a = args[0].detach().abs().amax().float().cpu()
            self.amax[name] = torch.maximum(self.amax[name], a) if name in self.amax else a

        return record

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
