"""``--load-format dummy`` (vLLM's name): the engine model built from config.json alone, random weights in the
checkpoint's precision, no shard read -- the full-size model serves for speed measurements without its 22-70 GB.

The precision of each module follows the config's ``quantization_config`` (or ``hf_quant_config.json``) by the
rules vLLM applies: NVFP4 for every linear the exclude list does not cover (ModelOpt NVFP4, compressed-
tensors), the per-module algorithm for ModelOpt MIXED_PRECISION, bf16 without a quantization config. The
MTP head (when the config declares one) is bf16 with bf16 experts, as ``fp4moe quantize`` writes it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from fp4moe.formats import nvfp4
from fp4moe.formats.layouts import OutputFormat, exclude_entry_matches
from fp4moe.layers.linear import Linear
from fp4moe.layers.moe import RoutedExperts
from fp4moe.models.qwen3_5_moe import ModelArgs, text_config_dict
from fp4moe.models.qwen3_5_moe_model import Qwen3_5MoeModel

# engine module names (relative to a decoder layer) that differ from the checkpoint's
_CHECKPOINT_NAMES = {
    "mlp.shared_gate_proj": "mlp.shared_expert.gate_proj",
    "mlp.shared_up_proj": "mlp.shared_expert.up_proj",
    "mlp.shared_down_proj": "mlp.shared_expert.down_proj",
}


def checkpoint_module(engine_name: str, text_prefix: str) -> str:
    """``layers.3.mlp.shared_gate_proj`` -> ``model.language_model.layers.3.mlp.shared_expert.gate_proj``."""
    if not engine_name.startswith("layers."):
        return engine_name  # lm_head
    _, idx, rest = engine_name.split(".", 2)
    return f"{text_prefix}layers.{idx}.{_CHECKPOINT_NAMES.get(rest, rest)}"


def module_precision(config: dict, path: Path | None = None) -> Callable[[str], str]:
    """A function: checkpoint module name -> "nvfp4", "fp8" or "bf16" by the checkpoint's quantization config."""
    from fp4moe.formats.layouts import detect_format

    fmt, exclude, problem = detect_format(config, path)
    declared = "quantization_config" in config or (
        path is not None and (path / "hf_quant_config.json").exists()
    )
    if problem and declared:
        raise ValueError(f"--load-format dummy: {problem}")
    if fmt is None:
        return lambda module: "bf16"
    qc = config.get("quantization_config") or {}
    layers = (
        qc.get("quantized_layers") if str(qc.get("quant_algo", "")).upper() == "MIXED_PRECISION" else None
    )
    if layers is None and path is not None and (Path(path) / "hf_quant_config.json").exists():
        import json

        q = json.loads((Path(path) / "hf_quant_config.json").read_text()).get("quantization", {})
        if str(q.get("quant_algo", "")).upper() == "MIXED_PRECISION":
            layers = q.get("quantized_layers")
    if layers is not None:
        return lambda module: str((layers.get(module) or {}).get("quant_algo", "bf16")).lower()

    def nvfp4_unless_excluded(module: str) -> str:
        if any(exclude_entry_matches(e, module, fmt or OutputFormat.MODELOPT) for e in exclude):
            return "bf16"
        return "nvfp4"

    return nvfp4_unless_excluded


def dummy_model(
    config: dict,
    args: ModelArgs,
    dtype: torch.dtype,
    device: torch.device,
    path: Path | None = None,
    seed: int = 0,
) -> Qwen3_5MoeModel:
    """The engine model of ``config`` with random weights (see ``fill_random``) on ``device``."""
    precision = module_precision(config, path)
    text_prefix = "model.language_model." if "text_config" in config else "model."
    with torch.device("meta"):
        model = Qwen3_5MoeModel(args)
        if int(text_config_dict(config).get("mtp_num_hidden_layers", 0) or 0) > 0:
            from fp4moe.models.qwen3_5_moe_model import MTPHead

            model.mtp = MTPHead(args)
    for name, module in model.named_modules():
        if name.startswith("mtp."):
            continue
        if isinstance(module, RoutedExperts):
            if precision(checkpoint_module(name, text_prefix)) == "nvfp4":
                module.use_nvfp4()
        elif isinstance(module, Linear):
            algo = precision(checkpoint_module(name, text_prefix))
            if algo == "nvfp4":
                module.use_nvfp4()
            elif algo == "fp8":
                module.use_fp8()
    model.to_empty(device=device)
    gen = None if device.type == "meta" else torch.Generator(device=device).manual_seed(seed)  # meta: sizing
    fill_random(model, gen, dtype)
    return model.eval()


@torch.no_grad()
def fill_random(
    module: torch.nn.Module, gen: torch.Generator | None, dtype: torch.dtype = torch.bfloat16
) -> None:
    """Random weights in place (on the module's device): random FP4 codes, FP8 block scales in [0.5, 2.5),
    small decode scales, zero-centred norms at zero, N(0, 0.02) elsewhere in ``dtype`` -- a model whose
    activations stay finite through every layer (what a speed measurement needs; its text is noise)."""
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        device = t.device
        if t.dtype == torch.uint8:
            t.random_(0, 256, generator=gen)
        elif t.dtype == nvfp4.FP8_DTYPE:
            t.copy_((torch.rand(t.shape, device=device, generator=gen) * 2 + 0.5).to(t.dtype))
        elif name.endswith(("decode", "decode_scale")):
            t.fill_(2e-3)
        elif name.endswith(".scale"):  # FP8 linears' per-tensor scale
            t.fill_(1e-2)
        elif "A_log" in name or "dt_bias" in name:
            t.data = torch.rand(t.shape, device=device, generator=gen).to(dtype)  # as load_model casts them
        elif name.endswith("norm_weight"):  # Gated DeltaNet's output norm: a plain weight
            t.data = torch.ones(t.shape, device=device, dtype=dtype)
        elif "norm" in name:
            t.data = torch.zeros(t.shape, device=device, dtype=dtype)
        else:
            t.data = (torch.randn(t.shape, device=device, generator=gen) * 0.02).to(dtype)
