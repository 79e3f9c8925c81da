"""How quantized experts are named on disk, and the quantization config that goes with them.

- ModelOpt NVFP4 (``--format modelopt``, default): per expert and projection ``weight`` uint8 [N, K/2],
  ``weight_scale`` e4m3 [N, K/16] row-major, ``weight_scale_2`` f32 0-D (decode scale amax/2688),
  ``input_scale`` f32 0-D (act_amax/2688). ``config.json`` gets ``quantization_config`` with
  ``quant_method: modelopt``; ``hf_quant_config.json`` carries the same facts in ModelOpt's shape.
- compressed-tensors ``nvfp4-pack-quantized``: ``weight_packed``, ``weight_scale``, ``weight_global_scale``
  [1] (= 2688/amax, the reciprocal), ``input_global_scale`` [1] (= 2688/act_amax).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable
from pathlib import Path

import torch

from fp4moe import __version__
from fp4moe.formats import nvfp4

GROUP_SIZE = nvfp4.BLOCK_SIZE


class OutputFormat(enum.Enum):
    MODELOPT = "modelopt"
    COMPRESSED_TENSORS = "compressed-tensors"


# suffixes of one quantized linear, by format; the first is the packed weight
SUFFIXES = {
    OutputFormat.MODELOPT: ("weight", "weight_scale", "weight_scale_2", "input_scale"),
    OutputFormat.COMPRESSED_TENSORS: (
        "weight_packed",
        "weight_scale",
        "weight_global_scale",
        "input_global_scale",
    ),
}


def quantized_linear_tensors(
    fmt: OutputFormat,
    q: nvfp4.NVFP4Tensor,
    weight_amax: torch.Tensor,
    input_amax: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """The tensors of one 2-D NVFP4 linear, keyed by suffix. ``weight_amax`` decides the global scale
    (pass the joint amax of gate and up for both, so they share it)."""
    if fmt is OutputFormat.MODELOPT:
        return modelopt_linear(
            q.packed,
            q.block_scales,
            nvfp4.weight_scale_2_from_amax(weight_amax),
            nvfp4.input_scale_from_amax(input_amax),
        )
    return {
        "weight_packed": q.packed,
        "weight_scale": q.block_scales,
        "weight_global_scale": q.global_scale.float().reshape(1),
        "input_global_scale": nvfp4.global_scale_from_amax(input_amax).reshape(1),
    }


def modelopt_linear(packed, block_scales, weight_scale_2, input_scale) -> dict[str, torch.Tensor]:
    """One ModelOpt NVFP4 linear's tensors keyed by ``SUFFIXES[MODELOPT]``, the two scalars stored 0-D."""
    values = (packed, block_scales, weight_scale_2.reshape(()), input_scale.reshape(()))
    return dict(zip(SUFFIXES[OutputFormat.MODELOPT], values, strict=True))


def read_quantized_linear(
    fmt: OutputFormat, tensors: dict[str, torch.Tensor], dtype=torch.float32
) -> torch.Tensor:
    """Dequantize one stored linear (keyed by suffix) in the format's own decode order."""
    if fmt is OutputFormat.MODELOPT:
        return nvfp4.dequantize_modelopt(
            tensors["weight"], tensors["weight_scale"], tensors["weight_scale_2"], dtype
        )
    return nvfp4.dequantize(
        tensors["weight_packed"], tensors["weight_scale"], tensors["weight_global_scale"].reshape(()), dtype
    )


def producer() -> dict[str, str]:
    return {"name": "fp4moe", "version": __version__}


def modelopt_quantization_config(exclude: list[str], kv_cache_quant_algo: str | None = None) -> dict:
    """``config.json`` -> ``quantization_config`` in the form ModelOpt's exporter writes (config_groups with
    weights and input activations, ``ignore``), plus ``group_size``/``exclude_modules``/``kv_cache_quant_algo``
    that older vLLM readers use. vLLM detects ``modelopt`` + ``NVFP4`` as modelopt_fp4."""
    fp4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": GROUP_SIZE}
    config = {
        "quant_method": "modelopt",
        "quant_algo": "NVFP4",
        "group_size": GROUP_SIZE,
        "config_groups": {
            "group_0": {"weights": dict(fp4), "input_activations": dict(fp4), "targets": ["Linear"]}
        },
        "ignore": list(exclude),
        "exclude_modules": list(exclude),
        "kv_cache_quant_algo": kv_cache_quant_algo,
        "producer": producer(),
    }
    if kv_cache_quant_algo == "FP8":
        config["kv_cache_scheme"] = {"dynamic": False, "num_bits": 8, "type": "float"}
    return config


def hf_quant_config(exclude: list[str], kv_cache_quant_algo: str | None = None) -> dict:
    """``hf_quant_config.json`` as ModelOpt writes it; every key vLLM requires is present."""
    return {
        "producer": producer(),
        "quantization": {
            "quant_algo": "NVFP4",
            "kv_cache_quant_algo": kv_cache_quant_algo,
            "group_size": GROUP_SIZE,
            "exclude_modules": list(exclude),
        },
    }


def modelopt_mixed_configs(
    exclude: list[str], kv_cache_quant_algo: str | None, layers: dict[str, str]
) -> tuple[dict, dict]:
    """(config.json quantization_config, hf_quant_config.json) for ModelOpt MIXED_PRECISION: ``layers`` maps
    module names (routed experts as their ``...mlp.experts`` module) to ``nvfp4`` or ``fp8``; every layer not
    listed is bf16 (vLLM >= 0.17)."""
    per_layer = {
        name: {"quant_algo": "NVFP4", "group_size": GROUP_SIZE} if algo == "nvfp4" else {"quant_algo": "FP8"}
        for name, algo in sorted(layers.items())
    }
    config = {
        "quant_method": "modelopt",
        "quant_algo": "MIXED_PRECISION",
        "quantized_layers": per_layer,
        "ignore": list(exclude),
        "exclude_modules": list(exclude),
        "kv_cache_quant_algo": kv_cache_quant_algo,
        "producer": producer(),
    }
    hf = {
        "producer": producer(),
        "quantization": {
            "quant_algo": "MIXED_PRECISION",
            "kv_cache_quant_algo": kv_cache_quant_algo,
            "exclude_modules": list(exclude),
            "quantized_layers": per_layer,
        },
    }
    return config, hf


def _ct_args(dynamic, observer: str) -> dict:
    return {
        "num_bits": 4,
        "type": "float",
        "symmetric": True,
        "group_size": GROUP_SIZE,
        "strategy": "tensor_group",
        "block_structure": None,
        "dynamic": dynamic,
        "actorder": None,
        "observer": observer,
        "observer_kwargs": {},
        "scale_dtype": "torch.float8_e4m3fn",
        "zp_dtype": None,
    }


def compressed_tensors_quantization_config(ignore: list[str], targets: list[str]) -> dict:
    """``quantization_config`` for ``nvfp4-pack-quantized`` (W4A4, scheme NVFP4), as llm-compressor writes it."""
    return {
        "quant_method": "compressed-tensors",
        "format": "nvfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": list(targets),
                "weights": _ct_args(False, "memoryless_minmax"),
                "input_activations": _ct_args("local", "static_minmax"),
                "output_activations": None,
                "format": "nvfp4-pack-quantized",
            }
        },
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "sparsity_config": {},
        "transform_config": {},
        "version": "0.20.1",
        "producer": producer(),
    }


def detect_format(
    config: dict, path: Path | None = None
) -> tuple[OutputFormat | None, list[str], str | None]:
    """(format, exclude entries, problem) from config.json's quantization_config, or from ModelOpt's
    hf_quant_config.json beside it when config.json has none."""
    qc = config.get("quantization_config")
    hf_file = Path(path) / "hf_quant_config.json" if path is not None else None
    if not isinstance(qc, dict) and hf_file is not None and hf_file.exists():
        try:
            q = json.loads(hf_file.read_text()).get("quantization", {})
        except (json.JSONDecodeError, AttributeError):
            q = {}
        if str(q.get("quant_algo", "")).upper() in ("NVFP4", "MIXED_PRECISION"):
            return OutputFormat.MODELOPT, list(q.get("exclude_modules") or []), None
    if not isinstance(qc, dict):
        return None, [], "config.json has no quantization_config: not a quantized checkpoint"
    method = qc.get("quant_method")
    if method == "modelopt":
        algo = str(qc.get("quant_algo", "")).upper()
        if algo not in ("NVFP4", "W4A16_NVFP4", "MIXED_PRECISION"):
            return None, [], f"quantization_config.quant_algo is {qc.get('quant_algo')!r}, not NVFP4"
        if algo == "MIXED_PRECISION" and not isinstance(qc.get("quantized_layers"), dict):
            return None, [], "MIXED_PRECISION quantization_config has no quantized_layers map"
        entries = qc.get("ignore") or qc.get("exclude_modules") or []
        return OutputFormat.MODELOPT, list(entries), None
    if method == "compressed-tensors":
        if qc.get("format") != "nvfp4-pack-quantized":
            return None, [], f"compressed-tensors format is {qc.get('format')!r}, not nvfp4-pack-quantized"
        return OutputFormat.COMPRESSED_TENSORS, list(qc.get("ignore") or []), None
    return None, [], f"quantization_config.quant_method {method!r} is neither modelopt nor compressed-tensors"


FLOAT_DTYPES = ("BF16", "F16", "F32")


def excluded_modules(
    tensors: dict[str, tuple[str, tuple[int, ...]]],
    fmt: OutputFormat,
    is_routed_expert: Callable[[str], bool],
) -> list[str]:
    """Every module left in bf16, by the names that really exist in the shards.

    ``tensors`` maps names to (safetensors dtype, shape); ``is_routed_expert(name)`` says which tensors are
    routed experts (the architecture's knowledge: ``models.qwen3_5_moe.classify``). One exact entry per module
    with a >=2-D float ``weight`` (already-quantized uint8 weights are never excluded) that is not a routed
    expert: attention and
    Gated DeltaNet projections (vLLM fuses q/k/v -> qkv_proj, in_proj_qkv/z -> in_proj_qkvz, b/a ->
    in_proj_ba and checks each shard by exact name, so all shards are listed), conv1d, shared experts,
    routers, embeddings, lm_head, vision tower (not in vLLM's defaults), MTP. vLLM maps the
    ``model.language_model.`` / ``model.visual.`` prefixes of these entries to its own module names.
    The MTP block's MoE is excluded as a module (``mtp.layers.N.mlp.experts``); compressed-tensors
    additionally gets ``re:`` entries, which vLLM does not remap (MTP and lm_head names are stable).
    """
    modules: set[str] = set()
    for name, (dtype, shape) in tensors.items():
        if name.startswith("mtp.") and ".mlp.experts." in name:
            if fmt is OutputFormat.MODELOPT:  # compressed-tensors matches exactly: its re: entry covers these
                modules.add(name[: name.index(".mlp.experts.") + len(".mlp.experts")])
            continue
        if not name.endswith(".weight") or len(shape) < 2 or is_routed_expert(name):
            continue
        if dtype not in FLOAT_DTYPES:
            continue
        modules.add(name.removesuffix(".weight"))
    entries = sorted(modules)
    if fmt is OutputFormat.COMPRESSED_TENSORS:
        entries += [r"re:^mtp\..*"] + ([r"re:.*lm_head$"] if "lm_head.weight" in tensors else [])
    return entries


# The reference build's fused NVFP4 experts (needed a patched vLLM loader): one tensor per block and
# kind, ``{experts_prefix}{gate_up_proj|down_proj}{suffix}``.
FUSED_NVFP4_SUFFIXES = ("", "_weight_scale", "_weight_scale_2", "_input_scale")


def module_of(tensor_name: str) -> str:
    """``a.b.weight_scale`` -> ``a.b`` (the module a tensor belongs to)."""
    return tensor_name.rsplit(".", 1)[0]


# vLLM's Qwen3.5 VL prefix mapping (checkpoint -> vLLM module names)
VLLM_PREFIXES = {
    "model.visual.": "visual.",
    "model.language_model.": "language_model.model.",
    "lm_head.": "language_model.lm_head.",
}


def vllm_name(module: str) -> str:
    for old, new in VLLM_PREFIXES.items():
        if module.startswith(old):
            return new + module[len(old) :]
    return "language_model.lm_head" if module == "lm_head" else module


def exclude_entry_matches(entry: str, module: str, fmt: OutputFormat) -> bool:
    """Does an exclude/ignore entry cover a module (a checkpoint name), by the rule vLLM applies?

    ModelOpt: exact, substring, or fnmatch (``foo*`` also as ``foo`` + ``foo.*``). compressed-tensors:
    ``re:`` entries by ``re.match``, others exactly. Entries may be written against checkpoint names or
    vLLM's mapped names (``visual.``, ``language_model.model.``); both are tried.
    """
    return any(_matches(entry, name, fmt) for name in {module, vllm_name(module)})


def _matches(entry: str, module: str, fmt: OutputFormat) -> bool:
    import fnmatch
    import re

    if fmt is OutputFormat.COMPRESSED_TENSORS:
        if entry.startswith("re:"):
            return re.match(entry[3:], module) is not None
        return entry == module
    if entry == module or entry in module:
        return True
    if fnmatch.fnmatch(module, entry):
        return True
    return entry.endswith("*") and not entry.endswith(".*") and fnmatch.fnmatch(module, entry[:-1] + ".*")
