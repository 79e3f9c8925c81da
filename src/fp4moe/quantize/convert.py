"""Rewrite an NVFP4 checkpoint with fused expert tensors (the reference build's layout, which needed a
patched vLLM loader) into per-expert ModelOpt tensors that stock vLLM loads.

Fused input, per MoE block ``P = ...mlp.experts.``:
  ``P gate_up_proj`` U8 [E, 2I, H/2] (gate rows first), ``P gate_up_proj_weight_scale`` E4M3 [E, 2I, H/16],
  ``P gate_up_proj_weight_scale_2`` F32 [E, 2] or [E] or scalar, ``P gate_up_proj_input_scale`` likewise;
  ``P down_proj`` U8 [E, H, I/2], ``P down_proj_weight_scale``, ``..._weight_scale_2`` [E], ``..._input_scale``.
Packed bytes and block scales are copied bit for bit. Where gate and up have different ``weight_scale_2``
(vLLM would silently use the gate's for both), the projection with the smaller one is re-quantized from
its decoded values under the larger, shared scale, and counted in the report. Input scales of gate and
up become their maximum (a larger activation scale never clips).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from fp4moe.formats import layouts, nvfp4
from fp4moe.formats.checkpoint import (
    INDEX_NAME,
    CheckpointError,
    CheckpointReader,
    ShardedWriter,
    atomic_output_dir,
    check_destination,
    copy_side_files,
    parse_size,
    recover_interrupted_output,
    write_json,
)
from fp4moe.formats.layouts import OutputFormat
from fp4moe.models import qwen3_5_moe as arch

MTP_FILE = "model-mtp.safetensors"


@dataclass
class ConvertReport:
    src: str
    dst: str
    blocks_converted: int = 0
    experts_converted: int = 0
    experts_requantized: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    def summary(self) -> str:
        return (
            f"converted {self.src} -> {self.dst}: {self.blocks_converted} fused MoE blocks, "
            f"{self.experts_converted} experts to per-expert ModelOpt NVFP4; "
            f"{len(self.experts_requantized)} projections re-quantized to a shared gate/up scale; "
            f"{self.seconds:.1f} s"
        )


def _per_expert_pair(t: torch.Tensor, num_experts: int, name: str) -> torch.Tensor:
    """A fused scale as [E, 2] (gate, up) or [E, 1]."""
    t = t.float()
    if t.ndim == 0 or t.numel() == 1:
        return t.reshape(1, 1).expand(num_experts, 1)
    if t.shape[0] != num_experts:
        raise CheckpointError(f"{name}: shape {tuple(t.shape)} does not have {num_experts} experts first")
    return t.reshape(num_experts, -1)


def fused_blocks(reader: CheckpointReader) -> list[str]:
    """Prefixes (``...mlp.experts.``) of every fused NVFP4 expert block."""
    return sorted(
        n[: -len("gate_up_proj_weight_scale")]
        for n in reader.names()
        if n.endswith("mlp.experts.gate_up_proj_weight_scale")
    )


def _requantize(packed, block_scales, s2_old, s2_new) -> tuple[torch.Tensor, torch.Tensor]:
    values = nvfp4.dequantize_modelopt(packed, block_scales, s2_old)
    q = nvfp4.quantize(values, global_scale=(1.0 / s2_new).reshape(()))
    return q.packed, q.block_scales


def convert_block(
    reader: CheckpointReader, writer: ShardedWriter, prefix: str, report: ConvertReport
) -> None:
    names = {
        f"{p}{s}": f"{prefix}{p}{s}"
        for p in ("gate_up_proj", "down_proj")
        for s in layouts.FUSED_NVFP4_SUFFIXES
    }
    missing = [n for n in names.values() if n not in reader]
    if missing:
        raise CheckpointError(f"fused NVFP4 block {prefix}*: missing {', '.join(missing)}")
    gu, gu_bs = reader.get(names["gate_up_proj"]), reader.get(names["gate_up_proj_weight_scale"])
    dn, dn_bs = reader.get(names["down_proj"]), reader.get(names["down_proj_weight_scale"])
    if gu.dtype != torch.uint8 or dn.dtype != torch.uint8:
        raise CheckpointError(
            f"{prefix}*: fused expert weights must be packed uint8, got {gu.dtype}/{dn.dtype}"
        )
    num_e, two_i = gu.shape[0], gu.shape[1]
    inter = two_i // 2
    gu_s2 = _per_expert_pair(
        reader.get(names["gate_up_proj_weight_scale_2"]), num_e, names["gate_up_proj_weight_scale_2"]
    )
    gu_in = _per_expert_pair(
        reader.get(names["gate_up_proj_input_scale"]), num_e, names["gate_up_proj_input_scale"]
    )
    dn_s2 = _per_expert_pair(
        reader.get(names["down_proj_weight_scale_2"]), num_e, names["down_proj_weight_scale_2"]
    )
    dn_in = _per_expert_pair(
        reader.get(names["down_proj_input_scale"]), num_e, names["down_proj_input_scale"]
    )
    for e in range(num_e):
        g = (gu[e, :inter], gu_bs[e, :inter], gu_s2[e, 0])
        u = (gu[e, inter:], gu_bs[e, inter:], gu_s2[e, -1])
        shared = torch.maximum(g[2], u[2])
        if not torch.equal(g[2], u[2]):
            proj, (p, bs, s2) = ("gate_proj", g) if g[2] < shared else ("up_proj", u)
            p, bs = _requantize(p, bs, s2, shared)
            g = (p, bs, shared) if proj == "gate_proj" else g
            u = (p, bs, shared) if proj == "up_proj" else u
            report.experts_requantized.append(f"{prefix}{e}.{proj}")
        in_scale = gu_in[e].max()
        for proj, (p, bs, _), s2, inp in (
            ("gate_proj", g, shared, in_scale),
            ("up_proj", u, shared, in_scale),
            ("down_proj", (dn[e], dn_bs[e], None), dn_s2[e, 0], dn_in[e, 0]),
        ):
            for suffix, t in layouts.modelopt_linear(p, bs, s2, inp).items():
                writer.add(f"{prefix}{e}.{proj}.{suffix}", t.clone())
    report.blocks_converted += 1
    report.experts_converted += num_e


def convert(
    src: str | Path,
    dst: str | Path,
    overwrite: bool = False,
    max_shard_size: str | int = "2GB",
    progress: bool = True,
) -> ConvertReport:
    from fp4moe.quantize.inspect import inspect_checkpoint

    t0 = time.perf_counter()
    src, dst = Path(src), Path(dst)
    check_destination(dst, overwrite)
    recover_interrupted_output(dst.resolve())
    if dst.exists() and not overwrite:  # an old DST put back by recovery
        raise FileExistsError(f"{dst} already exists; pass --overwrite to replace it")
    cfg = arch.ModelConfig.from_dir(src)
    qc = cfg.raw.get("quantization_config") or {}
    if qc.get("quant_method") != "modelopt":
        raise CheckpointError(
            f"{src}: convert reads ModelOpt NVFP4 checkpoints (quant_method {qc.get('quant_method')!r})"
        )
    reader = CheckpointReader(src)
    blocks = fused_blocks(reader)
    if not blocks:
        raise CheckpointError(
            f"{src}: no fused NVFP4 expert blocks (…mlp.experts.gate_up_proj_weight_scale) to convert"
        )
    report = ConvertReport(str(src), str(dst))
    fused_names = {
        f"{b}{p}{s}"
        for b in blocks
        for p in ("gate_up_proj", "down_proj")
        for s in layouts.FUSED_NVFP4_SUFFIXES
    }
    with atomic_output_dir(dst, overwrite=overwrite) as tmp:
        writer = ShardedWriter(tmp, parse_size(max_shard_size))
        if any(b.startswith("mtp.") for b in blocks):
            raise CheckpointError(
                f"{src}: fused NVFP4 MTP experts are not supported yet (MTP is expected in bf16)"
            )
        for prefix in tqdm(blocks, desc="fused MoE blocks", unit="block", disable=not progress):
            convert_block(reader, writer, prefix, report)
        rest = [n for n in reader.names() if n not in fused_names and not n.startswith("mtp.")]
        for name in tqdm(rest, desc="other tensors", unit="tensor", disable=not progress):
            writer.add(name, reader.get(name))
        mtp = [n for n in reader.names() if n.startswith("mtp.")]
        if mtp:
            writer.write_file(MTP_FILE, {n: reader.get(n) for n in mtp})
        writer.close()
        tensors = {n: (i.dtype, i.shape) for n, i in reader.infos.items() if n not in fused_names}
        entries = list(
            dict.fromkeys(
                [
                    *(qc.get("ignore") or qc.get("exclude_modules") or []),
                    *layouts.excluded_modules(tensors, OutputFormat.MODELOPT, arch.is_routed_expert),
                ]
            )
        )
        raw = dict(cfg.raw)
        raw["quantization_config"] = layouts.modelopt_quantization_config(
            entries, qc.get("kv_cache_quant_algo")
        )
        write_json(tmp / "config.json", raw)
        write_json(
            tmp / "hf_quant_config.json", layouts.hf_quant_config(entries, qc.get("kv_cache_quant_algo"))
        )
        copy_side_files(src, tmp, skip={"config.json", INDEX_NAME, "hf_quant_config.json"})
        check = inspect_checkpoint(tmp)
        if not check.ok:
            raise CheckpointError(
                "the converted checkpoint failed inspection:\n  " + "\n  ".join(check.problems)
            )
    report.seconds = time.perf_counter() - t0
    return report


def fuse_experts(
    tensors: dict[str, torch.Tensor], num_layers: int, num_experts: int, prefix: str = "model.language_model."
) -> dict[str, torch.Tensor]:
    """The inverse of ``convert``: per-expert ModelOpt NVFP4 tensors rewritten in the reference build's fused
    layout (gate rows first; ``weight_scale_2`` and ``input_scale`` per expert and projection). Builds the
    fused checkpoints that tests and the vLLM side-by-side run ``convert`` on."""
    out = dict(tensors)
    for i in range(num_layers):
        p = f"{prefix}layers.{i}.mlp.experts."

        def take(proj: str, suffix: str, p: str = p) -> list[torch.Tensor]:
            return [out.pop(f"{p}{e}.{proj}.{suffix}") for e in range(num_experts)]

        for suffix, fused in zip(
            layouts.SUFFIXES[OutputFormat.MODELOPT], layouts.FUSED_NVFP4_SUFFIXES, strict=True
        ):
            gate, up, down = take("gate_proj", suffix), take("up_proj", suffix), take("down_proj", suffix)
            join = torch.cat if suffix in ("weight", "weight_scale") else torch.stack
            out[f"{p}gate_up_proj{fused}"] = torch.stack(
                [join([g, u]) for g, u in zip(gate, up, strict=True)]
            )
            out[f"{p}down_proj{fused}"] = torch.stack(down)
    return out
