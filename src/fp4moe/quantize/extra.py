"""NVFP4 for more than the routed experts (``--quantize``): the calibration of their inputs. Which linears,
in which fused groups (``GROUPS``, ``parse_groups``, ``layer_groups``), is the architecture's knowledge:
``models.qwen3_5_moe``.

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
