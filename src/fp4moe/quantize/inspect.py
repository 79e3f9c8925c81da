"""Validate an NVFP4 qwen3_5_moe checkpoint (ours, ModelOpt's, llm-compressor's): complete and sound.

Checks every routed expert of every layer is quantized with all scales present, shaped and typed right,
finite and positive; gate/up share a global scale; the exclude list names real modules and covers every
bf16 linear (and no quantized expert); MTP and vision are present as the config says; sizes vs bf16. Against
the bf16 source (``reference``): nothing is lost, and every tensor kept under its name, dtype and shape is
byte-identical to the source's (streamed a chunk at a time).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from fp4moe.formats import kv_scales, layouts, sharding
from fp4moe.formats.checkpoint import CheckpointReader
from fp4moe.formats.layouts import SUFFIXES, OutputFormat, detect_format
from fp4moe.formats.nvfp4 import BLOCK_SIZE
from fp4moe.models import qwen3_5_moe as arch
from fp4moe.quantize.inspect_report import InspectReport, Problems
from fp4moe.quantize.source_compare import compare_with_source

SCALAR_SHAPES = ((), (1,))


def _expert_naming(reader: CheckpointReader) -> OutputFormat | None:
    """How the routed experts' NVFP4 tensors are named in the shards: compressed-tensors' ``weight_packed``,
    ModelOpt's ``weight_scale_2``, or None where no expert is packed (a bf16 checkpoint)."""
    names = [n for n in reader.names() if arch.is_routed_expert(n)]
    if any(n.endswith(".weight_packed") for n in names):
        return OutputFormat.COMPRESSED_TENSORS
    if any(n.endswith("weight_scale_2") for n in names):
        return OutputFormat.MODELOPT
    return None


def _check_quantization_config(
    config: dict, path: Path, reader: CheckpointReader, fmt: OutputFormat | None, report: InspectReport
) -> bool:
    """Whether the config that tells vLLM how to read the experts matches the tensors beside it: a packed
    checkpoint whose config.json lost its quantization_config (vLLM falls back to ModelOpt's
    hf_quant_config.json, other loaders do not; without either it would read the uint8 codes as bf16
    weights), a format other than the tensors', a group size other than 16, config.json and
    hf_quant_config.json disagreeing. False: the experts' own checks would only repeat the mismatch."""
    naming = _expert_naming(reader)
    qc = config.get("quantization_config")
    hf = path / "hf_quant_config.json"
    if naming is not None and not isinstance(qc, dict):
        if fmt is None:
            report.problems.append(
                f"the routed experts are packed NVFP4 ({naming.value} names) but config.json has no "
                "quantization_config and there is no hf_quant_config.json: vLLM would load the uint8 codes as "
                "bf16 weights; restore config.json from the build (or quantize again)"
            )
            return False
        report.warnings.append(
            "config.json has no quantization_config: vLLM reads hf_quant_config.json instead (ModelOpt's "
            "older layout), transformers and other loaders do not"
        )
    if naming is not None and fmt is not None and naming is not fmt:
        report.problems.append(
            f"quantization_config says {fmt.value} but the experts are stored with {naming.value}'s tensor names: "
            "the config does not belong to these shards"
        )
        return False
    if isinstance(qc, dict):
        sizes = {qc.get("group_size")} | {
            (g.get("weights") or {}).get("group_size")
            for g in (qc.get("config_groups") or {}).values()
            if isinstance(g, dict)
        }
        bad = sorted(str(s) for s in sizes - {None, BLOCK_SIZE})
        if bad:
            report.problems.append(
                f"quantization_config group_size {', '.join(bad)}: NVFP4 blocks are {BLOCK_SIZE} values"
            )
    if isinstance(qc, dict) and qc.get("quant_method") == "modelopt" and hf.exists():
        try:
            q = json.loads(hf.read_text()).get("quantization", {})
        except (json.JSONDecodeError, AttributeError):
            return True  # reported by _check_hf_quant_config
        a, b = str(qc.get("quant_algo", "")).upper(), str(q.get("quant_algo", "")).upper()
        if a != b:
            report.problems.append(
                f"quant_algo is {a} in config.json but {b} in hf_quant_config.json: rewrite one to match"
            )
    return True


def _check_hf_quant_config(path: Path, report: InspectReport) -> None:
    f = path / "hf_quant_config.json"
    if not f.exists():
        report.warnings.append("no hf_quant_config.json (vLLM uses config.json's quantization_config)")
        return
    try:
        q = json.loads(f.read_text()).get("quantization", {})
    except (json.JSONDecodeError, AttributeError) as e:
        report.problems.append(f"hf_quant_config.json is not valid JSON ({e})")
        return
    needed = ("quant_algo", "group_size", "kv_cache_quant_algo", "exclude_modules")
    if str(q.get("quant_algo", "")).upper() == "MIXED_PRECISION":
        needed = ("quant_algo", "kv_cache_quant_algo", "exclude_modules", "quantized_layers")
    missing = [k for k in needed if k not in q]
    if missing:
        report.problems.append(
            f"hf_quant_config.json 'quantization' lacks keys vLLM requires: {', '.join(missing)}"
        )
    if q.get("group_size") not in (None, BLOCK_SIZE):
        report.problems.append(f"hf_quant_config.json group_size {q.get('group_size')} is not {BLOCK_SIZE}")


def _declared_kv_cache(config: dict, path: Path, fmt: OutputFormat, problems: Problems) -> bool:
    """Whether the quantization config declares an fp8 KV cache (ModelOpt: ``kv_cache_quant_algo``, in
    config.json and hf_quant_config.json alike; compressed-tensors: ``kv_cache_scheme``)."""
    qc = config.get("quantization_config") or {}
    if fmt is OutputFormat.COMPRESSED_TENSORS:
        scheme = qc.get("kv_cache_scheme")
        if scheme is not None and (scheme.get("type"), scheme.get("num_bits"), scheme.get("strategy")) != (
            "float",
            8,
            "tensor",
        ):
            problems.add(
                "kv", f"kv_cache_scheme {scheme} is not per-tensor 8-bit float, the scales written here"
            )
        return scheme is not None
    algo = qc.get("kv_cache_quant_algo")
    hf = path / "hf_quant_config.json"
    if hf.exists():
        try:
            hf_algo = (json.loads(hf.read_text()).get("quantization") or {}).get("kv_cache_quant_algo")
        except (json.JSONDecodeError, AttributeError):
            hf_algo = algo  # reported by _check_hf_quant_config
        if hf_algo != algo:
            problems.add(
                "kv",
                f"kv_cache_quant_algo is {algo!r} in config.json but {hf_algo!r} in hf_quant_config.json",
            )
    if algo not in (None, "FP8"):
        problems.add("kv", f"kv_cache_quant_algo {algo!r}: only FP8 (or none) is supported")
    return algo == "FP8"


def _check_kv_scales(reader, cfg, fmt: OutputFormat, path: Path, prefix: str, report, problems) -> None:
    """Every full-attention layer has its k and v scale under the format's names, each a positive finite
    scalar, exactly where the config declares an fp8 KV cache."""
    declared = _declared_kv_cache(cfg.raw, path, fmt, problems)
    found = kv_scales.find(reader.names(), arch.layer_of)
    attention = [i for i, t in enumerate(cfg.text.layer_types) if t == "full_attention"]
    if not declared:
        if found:
            problems.add(
                "kv",
                f"k/v cache scales are present ({len(found)} layers) but the quantization config declares no "
                "fp8 KV cache (kv_cache_quant_algo FP8 / kv_cache_scheme): vLLM would not load them",
            )
        return
    for i in sorted(set(found) - set(attention)):
        problems.add("kv", f"layer {i} is not a full-attention layer but has k/v cache scales")
    for i in attention:
        for kind, name in zip("kv", kv_scales.names(fmt, f"{prefix}layers.{i}."), strict=True):
            if found.get(i, {}).get(kind) != name:
                other = found.get(i, {}).get(kind)
                problems.add(
                    "kv", f"{name} missing" + (f" ({other} found: the other format's name)" if other else "")
                )
                continue
            t = reader.get(name)
            if tuple(t.shape) not in SCALAR_SHAPES or not t.is_floating_point() or not _scalar_ok(t):
                problems.add("kv", f"{name} must be a positive finite scalar, got {t.dtype} {tuple(t.shape)}")
    report.kv_cache = f"fp8, k/v scales in {len(attention)} attention layer(s)"


def _scalar_ok(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all() and (t > 0).all())


def _check_expert(
    reader: CheckpointReader,
    fmt: OutputFormat,
    prefix: str,
    e: int,
    hidden: int,
    inter: int,
    problems: Problems,
) -> dict[str, torch.Tensor] | None:
    """Check one per-expert NVFP4 expert; returns its global scales by projection (None if broken)."""
    packed_sfx, block_sfx, global_sfx, input_sfx = SUFFIXES[fmt]
    shapes = {"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
    scales: dict[str, torch.Tensor] = {}
    for proj, (n, k) in shapes.items():
        base = f"{prefix}{e}.{proj}."
        if base + packed_sfx not in reader:
            dense = reader.infos.get(base + "weight")
            if dense is not None and dense.dtype in layouts.FLOAT_DTYPES:
                problems.add("bf16-expert", f"{base}weight is {dense.dtype}: routed expert left unquantized")
            else:
                problems.add("missing", f"{base}{packed_sfx} is missing")
            return None
        info = reader.info(base + packed_sfx)
        if info.dtype in layouts.FLOAT_DTYPES:
            problems.add("bf16-expert", f"{base}{packed_sfx} is {info.dtype}: routed expert left unquantized")
            return None
        expected = {
            packed_sfx: ("U8", (n, k // 2)),
            block_sfx: ("F8_E4M3", (n, k // BLOCK_SIZE)),
            global_sfx: ("F32", None),
            input_sfx: ("F32", None),
        }
        for sfx, (dtype, shape) in expected.items():
            name = base + sfx
            if name not in reader:
                problems.add("missing", f"{name} is missing")
                return None
            info = reader.info(name)
            if info.dtype != dtype:
                problems.add("dtype", f"{name} has dtype {info.dtype}, expected {dtype}")
            if shape is not None and info.shape != shape:
                problems.add("shape", f"{name} has shape {info.shape}, expected {shape}")
            if shape is None and info.shape not in SCALAR_SHAPES:
                problems.add("shape", f"{name} has shape {info.shape}, expected a scalar (0-D or [1])")
        for sfx in (global_sfx, input_sfx):
            t = reader.get(base + sfx)
            if not _scalar_ok(t.float()):
                problems.add("scale", f"{base}{sfx} = {t.flatten().tolist()} is not finite and positive")
        blocks = reader.get(base + block_sfx).float()
        if not _scalar_ok(blocks):
            bad = int((~torch.isfinite(blocks) | (blocks <= 0)).sum())
            problems.add("scale", f"{base}{block_sfx}: {bad} block scales are not finite and positive")
        scales[proj] = reader.get(base + global_sfx).float().reshape(())
    return scales


def _check_layer_experts(reader, fmt, cfg, prefix: str, report: InspectReport, problems: Problems) -> None:
    h, i_size, num_e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    if f"{prefix}gate_up_proj_weight_scale" in reader or (
        f"{prefix}gate_up_proj" in reader and reader.info(f"{prefix}gate_up_proj").dtype == "U8"
    ):
        report.experts_fused_nvfp4 += num_e
        problems.add(
            "fused-nvfp4",
            f"{prefix}*: NVFP4 experts stored fused with fused scales; stock vLLM drops or rejects these "
            "scales -- rewrite them with `fp4moe convert`",
        )
        return
    if f"{prefix}gate_up_proj" in reader:
        report.experts_bf16 += num_e
        problems.add(
            "bf16-expert",
            f"{prefix}gate_up_proj is {reader.info(prefix + 'gate_up_proj').dtype}: routed experts left unquantized",
        )
        return
    for e in range(num_e):
        scales = _check_expert(reader, fmt, prefix, e, h, i_size, problems)
        if scales is None:
            if (
                f"{prefix}{e}.gate_proj.weight" in reader
                and reader.info(f"{prefix}{e}.gate_proj.weight").dtype != "U8"
            ):
                report.experts_bf16 += 1
            continue
        report.experts_quantized += 1
        if not torch.equal(scales["gate_proj"], scales["up_proj"]):
            problems.add(
                "gate-up",
                f"{prefix}{e}: gate and up global scales differ ({scales['gate_proj'].item():.6g} vs "
                f"{scales['up_proj'].item():.6g}); vLLM keeps only the gate's",
            )


def _check_exclude_list(reader, fmt, entries: list[str], cfg, prefix: str, problems: Problems) -> None:
    modules = sorted({layouts.module_of(n) for n in reader.names()})
    for entry in entries:
        if not any(layouts.exclude_entry_matches(entry, m, fmt) for m in modules):
            problems.add("exclude-unmatched", f"exclude entry {entry!r} matches no tensor in the shards")
    for name in reader.names():
        info = reader.info(name)
        if (
            name.endswith(".weight")
            and len(info.shape) >= 2
            and info.dtype in ("BF16", "F16", "F32")
            and arch.classify(name) is not arch.Role.ROUTED_EXPERT
        ):
            module = layouts.module_of(name)
            if not name.startswith("mtp.") or ".mlp.experts." not in name:
                covered = any(layouts.exclude_entry_matches(e, module, fmt) for e in entries)
            else:  # MTP experts are excluded as their MoE module (or by expert-0 names for compressed-tensors)
                moe = name[: name.index(".mlp.experts.") + len(".mlp.experts")]
                covered = any(
                    layouts.exclude_entry_matches(e, m, fmt) for e in entries for m in (moe, module)
                )
            if not covered:
                problems.add(
                    "not-excluded",
                    f"{module} is {info.dtype} but not in the exclude list: vLLM would expect it quantized",
                )
    for name, info in reader.infos.items():
        if info.dtype == "U8" and arch.classify(name) is not arch.Role.ROUTED_EXPERT:
            module = layouts.module_of(name)
            hits = [e for e in entries if layouts.exclude_entry_matches(e, module, fmt)]
            if hits:
                problems.add(
                    "excludes-quantized",
                    f"exclude entry {hits[0]!r} covers {module}, whose weight is quantized (uint8)",
                )
    for i in range(cfg.num_layers):
        moe = f"{prefix}layers.{i}.mlp.experts"
        for m in (moe, f"{moe}.0.gate_proj", f"{moe}.0.down_proj"):
            hits = [e for e in entries if layouts.exclude_entry_matches(e, m, fmt)]
            if hits:
                problems.add(
                    "excludes-experts", f"exclude entry {hits[0]!r} covers the quantized routed experts {m}"
                )
                break


FUSED_IN_VLLM = (  # checkpoint shards vLLM loads into one module (qkv_proj, in_proj_qkvz, in_proj_ba, gate_up_proj)
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z"),
    ("linear_attn.in_proj_b", "linear_attn.in_proj_a"),
    ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"),
)


def _check_fused_groups(
    reader: CheckpointReader, fmt: OutputFormat, prefix: str, num_layers: int, problems
) -> None:
    """Shards that vLLM fuses must share a precision, and NVFP4 shards one global scale: vLLM dequantizes a
    fused module with the largest weight_scale_2 of its shards without requantizing the others."""
    packed_sfx, _, global_sfx, _ = layouts.SUFFIXES[fmt]
    for i in range(num_layers):
        for group in FUSED_IN_VLLM:
            mods = [f"{prefix}layers.{i}.{m}" for m in group]
            quantized = [
                f"{m}.{packed_sfx}" in reader and reader.info(f"{m}.{packed_sfx}").dtype == "U8" for m in mods
            ]
            present = [q or f"{m}.weight" in reader for m, q in zip(mods, quantized, strict=True)]
            fp8 = [f"{m}.weight" in reader and reader.info(f"{m}.weight").dtype == "F8_E4M3" for m in mods]
            if all(present) and any(fp8) and not all(fp8):
                problems.add(
                    "mixed-fused", f"{', '.join(mods)}: FP8 and another precision in one vLLM-fused module"
                )
                continue
            if not all(present):
                continue
            if any(quantized) and not all(quantized):
                problems.add(
                    "mixed-fused",
                    f"{', '.join(m for m, q in zip(mods, quantized, strict=True) if q)} NVFP4 but not the rest of "
                    f"the fused group {', '.join(mods)}: vLLM needs one precision per fused module",
                )
            elif all(quantized):
                scales = {float(reader.get(f"{m}.{global_sfx}").float().reshape(-1)[0]) for m in mods}
                if len(scales) > 1:
                    problems.add(
                        "fused-scales",
                        f"{', '.join(mods)} carry different global scales; vLLM uses one for the fused module "
                        "(the largest) without requantizing, so the others decode wrong",
                    )


def _sizes(reader: CheckpointReader, report: InspectReport) -> None:
    for name, info in reader.infos.items():
        report.bytes_on_disk += info.num_bytes
        if arch.classify(name) is not arch.Role.ROUTED_EXPERT:
            report.bytes_bf16_equivalent += info.num_bytes
        elif info.dtype == "U8":
            report.bytes_bf16_equivalent += (
                info.num_bytes * 4
            )  # two FP4 values per byte, 2 bytes each in bf16
        elif info.dtype in ("BF16", "F16"):
            report.bytes_bf16_equivalent += info.num_bytes
        # FP8 block scales and FP32 scalars have no bf16 counterpart


def inspect_checkpoint(
    path: str | Path, reference: CheckpointReader | None = None, split: tuple[int, bool] = (1, True)
) -> InspectReport:
    """Validate ``path``; ``reference`` (the bf16 source) adds a check that nothing was lost and that every
    tensor not quantized is byte-identical to the source's; ``split`` (GPUs, expert parallelism) that vLLM
    can split the shapes over that many GPUs (``formats.sharding``)."""
    path = Path(path)
    report = InspectReport(path=str(path))
    problems = Problems(report)
    # a path that is no checkpoint of this model (no config.json, another model_type, files safetensors would
    # refuse): an error (exit 2), never a report
    reader = CheckpointReader(path)
    cfg = arch.ModelConfig.from_dir(path)
    prefix = arch.text_prefix(reader)
    fmt, entries, problem = detect_format(cfg.raw, path)
    consistent = _check_quantization_config(cfg.raw, path, reader, fmt, report)
    if problem and consistent:
        report.problems.append(problem)
    fmt = fmt or OutputFormat.MODELOPT
    report.format = fmt.value if not problem else None
    report.num_layers, report.num_experts = cfg.text.num_layers, cfg.text.num_experts
    report.exclude_entries = len(entries)
    if fmt is OutputFormat.MODELOPT and not problem:
        _check_hf_quant_config(path, report)

    for i in range(cfg.text.num_layers if consistent else 0):
        _check_layer_experts(reader, fmt, cfg.text, f"{prefix}layers.{i}.mlp.experts.", report, problems)
    if not problem and consistent:
        _check_exclude_list(reader, fmt, entries, cfg.text, prefix, problems)
    _check_fused_groups(reader, fmt, prefix, cfg.text.num_layers, problems)
    if not problem:
        _check_kv_scales(reader, cfg, fmt, path, prefix, report, problems)

    report.mtp_tensors = sum(n.startswith("mtp.") for n in reader.names())
    report.vision_tensors = sum(arch.classify(n) is arch.Role.VISION for n in reader.names())
    if cfg.text.mtp_num_hidden_layers and not report.mtp_tensors:
        problems.add(
            "mtp",
            f"config declares mtp_num_hidden_layers={cfg.text.mtp_num_hidden_layers} but no mtp.* tensors exist",
        )
    if report.mtp_tensors and not cfg.text.mtp_num_hidden_layers:
        problems.add(
            "mtp", "mtp.* tensors are present but the config declares no MTP layer (mtp_num_hidden_layers)"
        )
    if cfg.has_vision and not report.vision_tensors:
        problems.add("vision", "config has a vision_config but no model.visual.* tensors exist")
    for found in sharding.problems(cfg.text, *split, nvfp4_experts=report.experts_quantized > 0):
        problems.add("split", f"--tensor-parallel-size {split[0]}: {found}")
    if reference is not None:
        compare_with_source(reader, reference, problems)
    _sizes(reader, report)
    problems.finish()
    return report
