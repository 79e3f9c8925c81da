"""The parts of a decoder layer the format search chooses for (``--budget``): the routed experts, the shared
expert, attention (full-attention layers) and the Gated DeltaNet projections (the other layers); which
formats each can take; the bytes each format stores; and the weights a part decodes to in a format, as the
writer would store them (``part_weights``), so a layer can run with one part quantized.

Everything else (routers, norms, conv1d, ``in_proj_b``/``in_proj_a``, ``shared_expert_gate``, embeddings,
lm_head, vision, MTP) is not a part: it stays bf16, as in every other build.
"""

from __future__ import annotations

import math

import torch

from fp4moe.formats import fp8, nvfp4
from fp4moe.models import qwen3_5_moe as arch
from fp4moe.quantize.calibrate import ExpertStats
from fp4moe.quantize.experts import quantize_expert_weights
from fp4moe.quantize.scales import ScaleMethod
from fp4moe.quantize.writing import quantize_linear_group

PARTS = ("experts", "shared", "attention", "deltanet")
EXPERT_TENSORS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")  # fused [E, 2I, H], [E, H, I]
BF16, FP8, NVFP4, NVFP4_GPTQ = "bf16", "fp8", "nvfp4", "nvfp4-gptq"
FORMATS = (BF16, FP8, NVFP4, NVFP4_GPTQ)
# What the search may write, per part. The routed experts are NVFP4 in every layer: fp4moe's engine loads
# NVFP4 experts in all layers or none, and vLLM 0.26 loading FP8 or bf16 routed experts in some layers of a
# ModelOpt MIXED_PRECISION checkpoint was never checked -- so their bf16 and FP8 costs are measured and
# shown, but not chosen. GPTQ (same bytes as NVFP4) is a candidate where ``--gptq`` asks for it.
WRITABLE = {"experts": (NVFP4, NVFP4_GPTQ), "shared": (BF16, FP8, NVFP4), "attention": (BF16, FP8, NVFP4),
            "deltanet": (BF16, FP8, NVFP4)}  # fmt: skip
SCALAR_BYTES = 4  # a 0-D float32 scale (weight_scale / weight_scale_2, input_scale)


def groups(part: str) -> list[list[str]]:
    """The fused groups of linears (names relative to a decoder layer) of a non-expert part."""
    return arch.GROUPS[part]


def layer_parts(tensor_names) -> list[str]:
    """The parts a decoder layer has (``tensor_names``: its tensors, relative to the layer, experts fused)."""
    out = ["experts"] if EXPERT_TENSORS[0] in tensor_names else []
    for part in ("shared", "attention", "deltanet"):
        if all(f"{m}.weight" in tensor_names for g in groups(part) for m in g):
            out.append(part)
    return out


def candidates(part: str, gptq: bool, fp8_allowed: bool) -> tuple[str, ...]:
    """Formats measured for ``part`` (besides bf16, whose KL is 0 by definition): every format, GPTQ only for
    the experts and only with ``--gptq``, FP8 only where the output format can store it (ModelOpt)."""
    out = [FP8, NVFP4] if fp8_allowed else [NVFP4]
    if part == "experts" and gptq:
        out.append(NVFP4_GPTQ)
    return tuple(out)


def _linear_bytes(shape: torch.Size, fmt: str, itemsize: int) -> int:
    n = math.prod(shape)
    if fmt == BF16:
        return n * itemsize
    if fmt == FP8:
        return n + 2 * SCALAR_BYTES  # e4m3 codes, weight_scale, input_scale
    # e2m1 codes two a byte, an e4m3 scale per 16, weight_scale_2 and input_scale
    return n // 2 + n // nvfp4.BLOCK_SIZE + 2 * SCALAR_BYTES


def part_bytes(shapes: dict[str, torch.Size], part: str, fmt: str, itemsize: int = 2) -> int:
    """Bytes ``part`` stores in ``fmt`` (safetensors headers left out). ``shapes``: the layer's weight shapes by
    name relative to the layer (experts fused); ``itemsize``: the source's bytes per bf16 weight. The routed
    experts are written per expert, each projection with its own scalars."""
    if part == "experts":
        gu, down = shapes[EXPERT_TENSORS[0]], shapes[EXPERT_TENSORS[1]]
        e, two_i, h = gu
        if fmt == BF16:
            return (math.prod(gu) + math.prod(down)) * itemsize
        per = 2 * _linear_bytes(torch.Size((two_i // 2, h)), fmt, itemsize)
        return e * (per + _linear_bytes(torch.Size(down[1:]), fmt, itemsize))
    return sum(_linear_bytes(shapes[f"{m}.weight"], fmt, itemsize) for g in groups(part) for m in g)


def part_params(shapes: dict[str, torch.Size], part: str) -> int:
    """Weights (parameters) in ``part``."""
    if part == "experts":
        return sum(math.prod(shapes[n]) for n in EXPERT_TENSORS)
    return sum(math.prod(shapes[f"{m}.weight"]) for g in groups(part) for m in g)


@torch.no_grad()
def part_weights(
    tensors: dict[str, torch.Tensor],
    part: str,
    fmt: str,
    method: ScaleMethod,
    device: torch.device,
    dtype: torch.dtype,
    stats: ExpertStats | None = None,
) -> dict[str, torch.Tensor]:
    """The weights ``part`` decodes to in ``fmt`` (names relative to the layer, ``dtype`` on ``device``): the
    quantization the writer stores (``writing.quantize_linear_group``: one scale per fused group;
    ``quantize_expert_weights``), decoded. ``stats`` with Hessians for ``nvfp4-gptq``."""
    if part == "experts":
        gu, down = (tensors[n] for n in EXPERT_TENSORS)
        if fmt == FP8:  # one scale per expert matrix, as ModelOpt's FP8 MoE stores them
            return {n: _fp8_roundtrip(w, dims=(-2, -1)).to(device=device, dtype=dtype)
                    for n, w in zip(EXPERT_TENSORS, (gu, down), strict=True)}  # fmt: skip
        if fmt == NVFP4_GPTQ and (stats is None or stats.gate_up_hessian is None):
            raise ValueError("nvfp4-gptq needs the layer's calibration Hessians")
        q_gu, q_d = quantize_expert_weights(
            gu.to(device), down.to(device), stats if fmt == NVFP4_GPTQ else None, method
        )
        return {EXPERT_TENSORS[0]: q_gu.dequantize(dtype).to(device),
                EXPERT_TENSORS[1]: q_d.dequantize(dtype).to(device)}  # fmt: skip
    out = {}
    for group in groups(part):
        _, scale, quantized = quantize_linear_group({m: tensors[f"{m}.weight"] for m in group}, method, device,
                                                    "fp8" if fmt == FP8 else "nvfp4")  # fmt: skip
        for m, q in quantized.items():
            out[f"{m}.weight"] = (fp8.decode(q, scale, dtype) if fmt == FP8 else q.dequantize(dtype)).to(device)
    return out


def _fp8_roundtrip(w: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    scale = fp8.scale_from_amax(w.abs().amax(dim=dims, keepdim=True))
    return fp8.decode(fp8.encode(w, scale), scale, torch.float32)


class Swapped:
    """Context manager: ``layer``'s parameters named in ``weights`` replaced by them, put back on exit."""

    def __init__(self, layer: torch.nn.Module, weights: dict[str, torch.Tensor]):
        self.layer, self.weights, self.saved = layer, weights, {}

    def __enter__(self):
        for name, w in self.weights.items():
            module_name, _, attr = name.rpartition(".")
            module = self.layer.get_submodule(module_name)
            self.saved[name] = getattr(module, attr)
            setattr(module, attr, torch.nn.Parameter(w, requires_grad=False))
        return self.layer

    def __exit__(self, *exc):
        for name, p in self.saved.items():
            module_name, _, attr = name.rpartition(".")
            setattr(self.layer.get_submodule(module_name), attr, p)
        self.saved.clear()
