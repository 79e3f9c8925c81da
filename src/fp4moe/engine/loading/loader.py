"""Checkpoint -> engine model: built on the meta device, tensors assigned once (no double allocation).

Reads bf16 checkpoints in every expert layout (fused 3-D, per-expert 2-D) and per-expert NVFP4 checkpoints
in ModelOpt (``weight``/``weight_scale``/``weight_scale_2``) and compressed-tensors (``weight_packed``/
``weight_scale``/``weight_global_scale``) form -- ours, ModelOpt's and llm-compressor's. NVFP4 experts
stay packed; their decode scale is ModelOpt's weight_scale_2 (= 1 / compressed-tensors' global scale).
Vision and MTP tensors are not part of the text model and are skipped here.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from fp4moe.formats import kv_scales
from fp4moe.formats.checkpoint import CheckpointError, CheckpointReader, not_a_checkpoint
from fp4moe.formats.layouts import SUFFIXES, OutputFormat, detect_format
from fp4moe.models import qwen3_5_moe as arch
from fp4moe.models.qwen3_5_moe import ModelArgs
from fp4moe.models.qwen3_5_moe_model import Qwen3_5MoeModel

LOAD_FORMATS = ("auto", "safetensors", "dummy")

# checkpoint name (relative to the layer) -> engine parameter (relative to the layer)
_RENAMES = {
    "linear_attn.conv1d.weight": "linear_attn.conv1d_weight",
    "linear_attn.norm.weight": "linear_attn.norm_weight",
    "mlp.shared_expert.gate_proj.weight": "mlp.shared_gate_proj.weight",
    "mlp.shared_expert.up_proj.weight": "mlp.shared_up_proj.weight",
    "mlp.shared_expert.down_proj.weight": "mlp.shared_down_proj.weight",
}


def merge_overrides(config: dict, overrides: dict | None) -> dict:
    """Apply ``--hf-overrides`` (a dict merged recursively into config.json, text_config included)."""
    if not overrides:
        return config
    out = dict(config)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_overrides(out[key], value)
        else:
            out[key] = value
    return out


def load_config(path: str | Path, hf_overrides: dict | None = None) -> dict:
    cfg_path = Path(path) / "config.json"
    if not cfg_path.exists():
        raise CheckpointError(not_a_checkpoint(path))
    config = json.loads(cfg_path.read_text())
    arch.ModelConfig.from_dict(config)  # validates model_type
    return merge_overrides(config, hf_overrides)


def _decode_scale(stored: torch.Tensor, fmt: OutputFormat) -> torch.Tensor:
    """ModelOpt stores the decode scale (weight_scale_2); compressed-tensors its reciprocal."""
    s = stored.float().reshape(())
    return s if fmt is OutputFormat.MODELOPT else 1.0 / s


def _experts_state(
    reader, fmt: OutputFormat | None, prefix: str, args: ModelArgs, dtype
) -> dict[str, torch.Tensor]:
    """Engine tensors of one layer's routed experts (``mlp.experts.*``)."""
    e_count = args.num_experts
    if fmt is None:  # bf16
        gate_up, down = arch.expert_block(reader, prefix, args).read(reader)
        return {"mlp.experts.gate_up_proj": gate_up.to(dtype), "mlp.experts.down_proj": down.to(dtype)}
    packed_sfx, scale_sfx, global_sfx, _ = SUFFIXES[fmt]
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("gu_p", "gu_s", "gu_d", "d_p", "d_s", "d_d")}
    for e in range(e_count):
        t = {
            (p, s): reader.get(f"{prefix}{e}.{p}.{s}")
            for p in arch.PROJECTIONS
            for s in (packed_sfx, scale_sfx, global_sfx)
        }
        decode = {p: _decode_scale(t[(p, global_sfx)], fmt) for p in arch.PROJECTIONS}
        parts["gu_p"].append(torch.cat([t[("gate_proj", packed_sfx)], t[("up_proj", packed_sfx)]]))
        parts["gu_s"].append(torch.cat([t[("gate_proj", scale_sfx)], t[("up_proj", scale_sfx)]]))
        parts["gu_d"].append(torch.stack([decode["gate_proj"], decode["up_proj"]]))
        parts["d_p"].append(t[("down_proj", packed_sfx)])
        parts["d_s"].append(t[("down_proj", scale_sfx)])
        parts["d_d"].append(decode["down_proj"])
    names = {
        "gu_p": "gate_up_packed",
        "gu_s": "gate_up_scales",
        "gu_d": "gate_up_decode",
        "d_p": "down_packed",
        "d_s": "down_scales",
        "d_d": "down_decode",
    }
    return {f"mlp.experts.{names[k]}": torch.stack(v) for k, v in parts.items()}


def load_model(
    path: str | Path,
    dtype: torch.dtype | str | None = None,
    device: str | torch.device = "cpu",
    hf_overrides: dict | None = None,
    load_format: str = "auto",
) -> tuple[Qwen3_5MoeModel, dict]:
    """Build the engine model from a checkpoint directory; returns (model, merged config).

    ``load_format``: "auto"/"safetensors" read the shards; "dummy" builds the model from config.json alone
    with random weights in the checkpoint's precision (``engine.loading.dummy``; dtype "auto" is bf16 there)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r}: choose from {', '.join(LOAD_FORMATS)}")
    config = load_config(path, hf_overrides)
    text = arch.text_config_dict(config)
    args = ModelArgs.from_text_config(text)
    if load_format == "dummy":
        from fp4moe.engine.loading.dummy import dummy_model

        dtype = torch.bfloat16 if dtype in (None, "auto") else dtype
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        return dummy_model(config, args, dtype, torch.device(device), Path(path)), config
    reader = CheckpointReader(path)
    prefix = arch.text_prefix(reader)
    fmt, _, problem = detect_format(config, Path(path))
    if problem and ("quantization_config" in config or (Path(path) / "hf_quant_config.json").exists()):
        raise CheckpointError(f"{path}: {problem}")
    if dtype in (None, "auto"):
        info = reader.info(f"{prefix}embed_tokens.weight")
        dtype = info.torch_dtype if info.torch_dtype and info.torch_dtype.is_floating_point else torch.float32
    elif isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    with torch.device("meta"):
        model = Qwen3_5MoeModel(args)
        has_mtp = any(n.startswith("mtp.fc.") for n in reader.names())
        if has_mtp:
            from fp4moe.models.qwen3_5_moe_model import MTPHead

            model.mtp = MTPHead(args)
    if fmt is not None:
        for layer in model.layers:
            layer.mlp.experts.use_nvfp4()

    state: dict[str, torch.Tensor] = {}

    def get(name: str, cast: bool = True) -> torch.Tensor:
        t = reader.get(name)
        return t.to(device=device, dtype=dtype) if cast and t.is_floating_point() else t.to(device)

    quantized = _quantized_linears(reader, prefix)
    for module, (qfmt, ckpt_module) in quantized.items():
        model.get_submodule(module).use_nvfp4()
        packed_sfx, scale_sfx, global_sfx, _ = SUFFIXES[qfmt]
        state[f"{module}.nvfp4.packed"] = get(f"{ckpt_module}.{packed_sfx}")
        state[f"{module}.nvfp4.block_scales"] = get(f"{ckpt_module}.{scale_sfx}", cast=False)
        state[f"{module}.nvfp4.decode_scale"] = _decode_scale(
            reader.get(f"{ckpt_module}.{global_sfx}"), qfmt
        ).to(device)
    skip = {f"{m}.{sfx}" for _, (f, m) in quantized.items() for sfx in SUFFIXES[f]}
    for module, ckpt_module in _fp8_linears(reader).items():  # per-tensor FP8 (ModelOpt MIXED_PRECISION)
        model.get_submodule(module).use_fp8()
        state[f"{module}.fp8.weight"] = get(f"{ckpt_module}.weight", cast=False)
        state[f"{module}.fp8.scale"] = (
            reader.get(f"{ckpt_module}.weight_scale").float().reshape(()).to(device)
        )
        skip.update(f"{ckpt_module}.{sfx}" for sfx in ("weight", "weight_scale", "input_scale"))
    model.kv_scales = {}  # calibrated fp8 KV-cache scales (quantize --kv-cache-dtype fp8), by layer
    for layer, found in kv_scales.find(reader.names(), arch.layer_of).items():
        if set(found) == {"k", "v"}:
            model.kv_scales[layer] = tuple(reader.get(found[kind]).float().reshape(()) for kind in "kv")
        skip.update(found.values())
    for name in reader.names():
        role = arch.classify(name)
        if role is arch.Role.MTP and has_mtp:
            if name.startswith("mtp.layers.0."):
                rest = name[len("mtp.layers.0.") :]
                if not rest.startswith("mlp.experts."):
                    state[f"mtp.layer.{_RENAMES.get(rest, rest)}"] = get(name)
            else:
                state[name] = get(name)
            continue
        if role in (arch.Role.VISION, arch.Role.MTP, arch.Role.ROUTED_EXPERT) or name in skip:
            continue
        if name == f"{prefix}embed_tokens.weight":
            state["embed_tokens"] = get(name)
        elif name == f"{prefix}norm.weight":
            state["norm.weight"] = get(name)
        elif name == "lm_head.weight":
            state["lm_head.weight"] = get(name)
        elif (idx := arch.layer_of(name)) is not None:
            rest = arch.strip_layer_prefix(name)
            state[f"layers.{idx}.{_RENAMES.get(rest, rest)}"] = get(name)
    if "lm_head.weight" not in state and (
        config.get("tie_word_embeddings") or text.get("tie_word_embeddings")
    ):
        state["lm_head.weight"] = state["embed_tokens"]
    for idx in range(args.num_layers):
        for k, v in _experts_state(reader, fmt, f"{prefix}layers.{idx}.mlp.experts.", args, dtype).items():
            state[f"layers.{idx}.{k}"] = v.to(device)
    if has_mtp:  # bf16 MTP experts, fused (Qwen3.6) or per-expert (Qwen3.5)
        for k, v in _experts_state(reader, None, "mtp.layers.0.mlp.experts.", args, dtype).items():
            state[f"mtp.layer.{k}"] = v.to(device)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise CheckpointError(f"{path}: tensors missing {missing[:5]} / unexpected {unexpected[:5]}")
    return model.eval(), config


def _engine_module(name: str) -> str:
    """Checkpoint module name (``...layers.3.self_attn.q_proj`` / ``lm_head``) -> engine module path."""
    if name == "lm_head":
        return "lm_head"
    idx = arch.layer_of(name + ".weight")
    if idx is None:
        raise CheckpointError(
            f"{name}: a quantized non-expert linear outside the decoder layers is not supported"
        )
    rest = arch.strip_layer_prefix(name + ".weight")
    return f"layers.{idx}.{_RENAMES.get(rest, rest).removesuffix('.weight')}"


def _fp8_linears(reader: CheckpointReader) -> dict[str, str]:
    """Per-tensor FP8 linears (weight e4m3 + scalar weight_scale): engine module path -> checkpoint module."""
    found = {}
    for name, info in reader.infos.items():
        if info.dtype != "F8_E4M3" or not name.endswith(".weight") or len(info.shape) != 2:
            continue
        if arch.classify(name) in (arch.Role.ROUTED_EXPERT, arch.Role.VISION, arch.Role.MTP):
            continue
        module = name.removesuffix(".weight")
        if f"{module}.weight_scale" in reader and reader.info(f"{module}.weight_scale").dtype == "F32":
            found[_engine_module(module)] = module
    return found


def _quantized_linears(reader: CheckpointReader, prefix: str) -> dict[str, tuple[OutputFormat, str]]:
    """NVFP4 linears other than the routed experts (e.g. shared experts or attention in llm-compressor or
    ModelOpt recipes): engine module path -> (format, checkpoint module name)."""
    found = {}
    for name, info in reader.infos.items():
        if arch.classify(name) in (arch.Role.ROUTED_EXPERT, arch.Role.VISION, arch.Role.MTP):
            continue
        if name.endswith(".weight_packed"):
            fmt, module = OutputFormat.COMPRESSED_TENSORS, name.removesuffix(".weight_packed")
        elif name.endswith(".weight") and info.dtype == "U8":
            fmt, module = OutputFormat.MODELOPT, name.removesuffix(".weight")
        else:
            continue
        found[_engine_module(module)] = (fmt, module)
    return found
