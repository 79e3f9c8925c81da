"""Calibrated fp8 KV-cache scales in a checkpoint: one float32 scalar per full-attention layer for its keys
and one for its values, ``scale = amax / 448`` (the cache stores ``k / k_scale`` as float8-e4m3 and reads
``stored * k_scale``), under the names vLLM's loader maps onto its attention layers:

- ModelOpt: ``<layer>.self_attn.k_proj.k_scale`` and ``<layer>.self_attn.v_proj.v_scale`` (what ModelOpt's
  exporter writes; vLLM's ``QuantizationConfig.get_cache_scale_mapper`` renames them to
  ``<layer>.self_attn.attn.{k,v}_scale``), declared by ``kv_cache_quant_algo: "FP8"``;
- compressed-tensors: ``<layer>.self_attn.k_scale`` / ``v_scale`` (the mapper's default rule), declared by
  ``kv_cache_scheme`` (8-bit float, per tensor, symmetric, static).

The keys are those the cache holds: after the k-norm and the rotary embedding."""

from __future__ import annotations

import torch

from fp4moe.formats import fp8
from fp4moe.formats.layouts import OutputFormat

SUFFIXES = {
    OutputFormat.MODELOPT: ("self_attn.k_proj.k_scale", "self_attn.v_proj.v_scale"),
    OutputFormat.COMPRESSED_TENSORS: ("self_attn.k_scale", "self_attn.v_scale"),
}
ALL_SUFFIXES = tuple(s for pair in SUFFIXES.values() for s in pair)


def names(fmt: OutputFormat, layer_prefix: str) -> tuple[str, str]:
    """The k and v scale tensor names of the decoder layer at ``layer_prefix`` (ending with '.')."""
    k, v = SUFFIXES[OutputFormat(fmt)]
    return layer_prefix + k, layer_prefix + v


def is_kv_scale(name: str) -> bool:
    return name.endswith(ALL_SUFFIXES)


def compressed_tensors_scheme() -> dict:
    """``quantization_config.kv_cache_scheme`` of a compressed-tensors checkpoint with per-tensor fp8 k/v."""
    return {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


def scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """ModelOpt's and llm-compressor's static per-tensor scale: amax / 448 (0-D float32; a layer that never
    saw a nonzero value gets 1.0, vLLM's own default)."""
    amax = amax.float().reshape(())
    return torch.where(amax > 0, amax / fp8.MAX, torch.ones(())).float()


def find(tensor_names, layer_of) -> dict[int, dict[str, str]]:
    """{layer index: {"k": name, "v": name}} of the kv-scale tensors among ``tensor_names``; ``layer_of(name)``
    gives a name's decoder layer index (None for names outside the decoder layers, e.g. the MTP head's)."""
    found: dict[int, dict[str, str]] = {}
    for name in tensor_names:
        if not is_kv_scale(name):
            continue
        layer = layer_of(name)
        if layer is not None:
            found.setdefault(layer, {})["k" if name.endswith("k_scale") else "v"] = name
    return found
