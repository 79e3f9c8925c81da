"""Where an fp8 KV cache's scales come from: fixed before the first request, never from traffic.

Per attention layer one scale for the keys and one for the values (float32 scalars; the cache stores
``x / scale`` as float8-e4m3 and reads ``stored * scale``, as vLLM does):

1. the checkpoint's calibrated scales (``quantize --kv-cache-dtype fp8``, ``formats.kv_scales``), read by the
   loader into ``model.kv_scales``;
2. for the layers it has none for (every layer of a checkpoint without scales; the MTP head's layer, which
   ``quantize`` does not run): ``calibrate``, at start-up, on the packaged calibration text (the CPython
   documentation excerpts ``quantize`` calibrates on by default) through the model's own modules with a
   bf16 cache -- amax over those tokens with ``HEADROOM``, over e4m3's 448.

Either way the scales are fixed when the engine starts, so a request's answer does not depend on which
requests came before it."""

from __future__ import annotations

import logging

import torch

from fp4moe.engine.reference.cache import DeltaNetStates, KVCache
from fp4moe.engine.reference.context import StepContext
from fp4moe.formats import fp8

log = logging.getLogger(__name__)

Scales = dict[int, tuple[torch.Tensor, torch.Tensor]]  # layer id -> (k scale, v scale), float32 0-D

CALIBRATION_TOKENS = 2048  # tokens of the packaged text run at start-up (one sequence)
HEADROOM = 1.25  # start-up scales: amax x this / 448 (a short text may not see a layer's largest values)


class _RecordingCache(KVCache):
    """A bf16 cache that keeps the amax of every layer's keys and values as they are written."""

    def __init__(self):
        super().__init__("auto")
        self.amax: dict[int, torch.Tensor] = {}

    def append(self, layer, slot, k, v):
        seen = torch.stack([k.detach().abs().amax().float(), v.detach().abs().amax().float()]).cpu()
        self.amax[layer] = seen if layer not in self.amax else torch.maximum(self.amax[layer], seen)
        return super().append(layer, slot, k, v)


def calibration_ids(tokenizer, vocab_size: int, num_tokens: int = CALIBRATION_TOKENS) -> list[int]:
    """The first ``num_tokens`` tokens of the packaged calibration text (ids at or past ``vocab_size``,
    which a test model's vocabulary may not hold, are dropped; no tokenizer: the text's bytes)."""
    from fp4moe.data import corpus_text

    text = corpus_text("calib")[: num_tokens * 16]
    # a checkpoint without tokenizer files (a --load-format dummy directory): the text's bytes as ids
    ids = list(text.encode()) if tokenizer is None else tokenizer(text, add_special_tokens=False)["input_ids"]
    ids = [i for i in ids if i < vocab_size][:num_tokens]
    if len(ids) < 2:
        raise ValueError("the calibration text gave fewer than 2 tokens in the model's vocabulary")
    return ids


@torch.no_grad()
def calibrate(model, ids: list[int], device: torch.device, headroom: float = HEADROOM) -> Scales:
    """Scales of every attention layer (and the MTP head's, given 2 tokens or more) from one forward of
    ``ids`` through the model's modules with a bf16 cache: each layer's amax of what it writes, times
    ``headroom``, over 448."""
    a = model.args
    kv = _RecordingCache()
    states = DeltaNetStates(
        a.conv_dim, a.conv_kernel, a.linear_num_value_heads, a.linear_key_head_dim, a.linear_value_head_dim,
        model.embed_tokens.dtype, device,
    )  # fmt: skip
    n = len(ids)
    tokens = torch.tensor(ids, dtype=torch.long, device=device)
    positions = torch.arange(n, device=device).expand(3, -1)
    hidden = model(tokens, positions, StepContext([n], [0], [0], kv, states))
    if (
        model.mtp is not None and n > 1
    ):  # its layer sees the target's states and the next tokens, as it drafts
        ctx = StepContext([n - 1], [0], [0], kv, states)  # its own layer id: no clash with the target's
        model.mtp(model, tokens[1:], hidden[:-1], positions[:, : n - 1], ctx)
    return {
        layer: tuple(fp8.scale_from_amax(m, headroom, floor=1e-8).reshape(()) for m in amax)
        for layer, amax in sorted(kv.amax.items())
    }


def resolve(model, layer_ids: list[int], tokenizer, device: torch.device) -> tuple[Scales, str]:
    """The scales of ``layer_ids``: the checkpoint's where it has them, the rest calibrated at start-up;
    and a line saying which is which (logged at start-up)."""
    scales: Scales = {i: s for i, s in getattr(model, "kv_scales", {}).items() if i in layer_ids}
    missing = [i for i in layer_ids if i not in scales]
    if missing:
        calibrated = calibrate(model, calibration_ids(tokenizer, model.args.vocab_size), device)
        scales.update({i: calibrated[i] for i in missing})
    where = (
        "calibrated at start-up on the packaged text" if len(missing) == len(layer_ids)
        else "the checkpoint's" + (f"; layers {missing} calibrated at start-up" if missing else "")
    )  # fmt: skip
    line = (
        f"fp8 KV cache scales: {where} (k/v per layer: "
        + ", ".join(f"{i}: {float(k):.3g}/{float(v):.3g}" for i, (k, v) in sorted(scales.items()))
        + ")"
    )
    return {i: (k.float().to(device), v.float().to(device)) for i, (k, v) in scales.items()}, line


def setup(runner, model, tokenizer, device: torch.device) -> str:
    """Fix ``runner``'s fp8 cache scales (``resolve`` over every attention layer and the MTP head's) ->
    the line saying where they came from."""
    layers = [i for i, layer in enumerate(model.layers) if layer.is_attention]
    layers += [model.mtp.layer_id] if model.mtp is not None else []
    scales, line = resolve(model, layers, tokenizer, device)
    runner.set_kv_scales(scales)
    return line
