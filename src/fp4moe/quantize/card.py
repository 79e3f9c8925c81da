"""The model card ``quantize`` writes beside the weights (``README.md``: Hugging Face metadata, what is in which
precision and why, the recipe, calibration, sizes, ``inspect``'s verdict, how to serve it) and the recipe
it records in ``hf_quant_config.json`` (every option that changed the bytes), so a build can be reproduced.
``fp4moe eval --card`` fills the card's quality section (``replace_quality``)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from fp4moe import __version__
from fp4moe.models import qwen3_5_moe as arch
from fp4moe.models.vllm_recipe import vllm_serve_command
from fp4moe.quantize.options import QuantizeOptions, QuantizeReport

CARD_NAME = "README.md"
QUALITY_BEGIN, QUALITY_END = "<!-- fp4moe:quality:begin -->", "<!-- fp4moe:quality:end -->"
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

SCALE_METHODS = {
    "mse": "per 16-value block, the FP8-E4M3 scale of least squared error among round-to-nearest's, its six "
    "neighbours each side and four-over-six's (never a larger block error than round-to-nearest)",
    "rtn": "round-to-nearest from each 16-value block's largest magnitude (what ModelOpt and llm-compressor write)",
    "4over6": "per 16-value block, the largest magnitude maps to 6 or to 4, whichever leaves less squared error",
}
WHY = {
    "experts": "most of the parameters (each token reads only its top-k experts, so decoding is bound by "
    "reading them); NVFP4 cuts them to about 4.5 bits a weight",
    "attention": "attention q/k/v/o projections",
    "deltanet": "Gated DeltaNet in_proj_qkv + in_proj_z and out_proj",
    "shared": "the shared expert",
    "lm_head": "the output projection",
}


def recipe(
    options: QuantizeOptions, calibration: str, calibration_tokens: int, search: dict | None = None
) -> dict:
    """Every option that changed the written bytes, the tool's version and the calibration actually used
    (with a format search: its target and the formats it chose, per layer and part)."""
    out = {
        "tool": "fp4moe",
        "version": __version__,
        "format": options.format.value,
        "scale_method": options.scale_method.value,
        "gptq": options.gptq,
        "quantize": ["experts", *options.quantize_extra],
        "kv_cache_quant_algo": options.kv_cache_quant_algo,
        "calibration": {
            "text": calibration,
            "calib_file": Path(options.calib_file).name if options.calib_file else None,
            "calib_dataset": options.calib_dataset,
            "num_samples": options.num_samples,
            "seq_len": options.seq_len,
            "tokens": calibration_tokens,
            "seed": options.seed,
            "calibrate_all_experts": options.calibrate_all_experts,
            "batch_size": options.batch_size,
            "calib_dtype": options.calib_dtype,
        },
        "max_shard_size": options.max_shard_size,
    }
    if search is not None:
        out["search"] = {
            "target": search["target"],
            "sensitivity_samples": options.sensitivity_samples,
            "formats": {f"{r['layer']}.{r['part']}": r["format"] for r in search["formats"]},
        }
    return out


def command_line(src: Path, dst: Path, options: QuantizeOptions) -> str:
    """The ``fp4moe quantize`` command that makes the same bytes (defaults left out); SRC and DST by their
    folder names, so a published card does not show this machine's paths."""
    d = QuantizeOptions()
    args = ["fp4moe", "quantize", src.resolve().name, dst.name]
    pairs = [
        ("--format", options.format.value, d.format.value),
        ("--scale-method", options.scale_method.value, d.scale_method.value),
        ("--quantize", ",".join(["experts", *options.quantize_extra]), "experts"),
        ("--calib-file", options.calib_file and Path(options.calib_file).name, None),
        ("--calib-dataset", options.calib_dataset, None),
        ("--num-samples", options.num_samples, d.num_samples),
        ("--seq-len", options.seq_len, d.seq_len),
        ("--seed", options.seed, d.seed),
        ("--batch-size", options.batch_size, d.batch_size),
        ("--calib-dtype", options.calib_dtype, d.calib_dtype),
        ("--kv-cache-quant-algo", options.kv_cache_quant_algo, None),
        ("--sensitivity-samples", options.sensitivity_samples, d.sensitivity_samples),
    ]
    args += [x for flag, value, default in pairs if value != default for x in (flag, str(value))]
    args += ["--gptq"] if options.gptq else []
    args += ["--calibrate-all-experts"] if options.calibrate_all_experts else []
    args += ["--base-model", options.base_model] if options.base_model else []
    if options.target is not None:
        t = options.target
        flag = {"kl": ["--budget", f"kl={t.value!r}"], "bytes": ["--target-bytes", str(int(t.value))],
                "bpw": ["--target-bpw", repr(t.value)]}[t.kind]  # fmt: skip
        # the stored table makes the same choice without measuring again (bit for bit on any device)
        args += [*flag, "--sensitivity", f"{dst.name}/sensitivity.json"]
    return shlex.join(args)


def source_license(src: Path) -> dict[str, str]:
    """``license`` (and ``license_name``/``license_link``) from the front matter of the source's own card."""
    card = src / CARD_NAME
    if not card.is_file():
        return {}
    text = card.read_text(encoding="utf-8", errors="replace")
    m = re.match(r"---\n(.*?)\n---", text, re.S)
    if not m:
        return {}
    found = {}
    for line in m.group(1).splitlines():
        key, _, value = line.partition(":")
        if key in ("license", "license_name", "license_link") and value.strip():
            found[key] = value.strip()
    return found


def base_model(src: Path, config: dict, given: str | None = None) -> str | None:
    """The source's hub id: ``--base-model``, else what its config records, else None (unknown)."""
    name = given or str(config.get("_name_or_path") or "")
    return name if HUB_ID.match(name) else None


def _size(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _front_matter(src: Path, config: dict, options: QuantizeOptions, has_vision: bool) -> str:
    tags = ["fp4moe", "nvfp4", options.format.value, "quantized", "moe", config.get("model_type", "")]
    if arch.uses_fp8(options.quantize_extra):
        tags.append("fp8")
    base = base_model(src, config, options.base_model)
    lines = [
        "---",
        *([f"base_model: {base}", "base_model_relation: quantized"] if base else []),
        "library_name: vllm",
        f"pipeline_tag: {'image-text-to-text' if has_vision else 'text-generation'}",
        *[f"{k}: {v}" for k, v in source_license(src).items()],
        "tags:",
        *[f"- {t}" for t in tags if t],
        "---",
    ]
    return "\n".join(lines)


def search_section(search: dict) -> list[str]:
    """The card's account of a format search: the target, predicted against measured KL, and the format
    chosen for every layer and part."""
    t = search["target"]
    target = {"kl": f"`--budget kl={t['value']:g}` (predicted mean KL per token, nats)",
              "bytes": f"`--target-bytes {int(t['value'])}`", "bpw": f"`--target-bpw {t['value']:g}`"}[t["kind"]]  # fmt: skip
    measured = "not measured" if search["measured_kl"] is None else f"{search['measured_kl']:.5g}"
    by_layer: dict[int, dict[str, str]] = {}
    for r in search["formats"]:
        by_layer.setdefault(r["layer"], {})[r["part"]] = r["format"]
    rows = [
        "## Formats chosen per layer (search)",
        "",
        f"Target: {target}. Each part's cost was measured as the KL(bf16 ‖ model) over the full vocabulary on "
        f"{search['held_out_tokens']:,} held-out calibration tokens with only that part in that format "
        "(`sensitivity.json`, plotted in `sensitivity.png`); the search took "
        + ("the fewest bytes whose predicted KL" if t["kind"] == "kl" else "the least predicted KL")
        + " (the sum of the chosen parts' KLs, a first-order model) "
        + ("meets the target." if t["kind"] == "kl" else "within the target's size."),
        "",
        f"- Predicted KL: {search['predicted_kl']:.5g}; measured KL of the whole build on the same held-out "
        f"tokens: {measured}.",
        f"- {search['bits_per_weight']:.3f} bits per searched weight; {_size(search['bytes'])} of tensors.",
        "",
        "| layer | routed experts | shared expert | attention / Gated DeltaNet |",
        "|---|---|---|---|",
    ]
    for layer, chosen in sorted(by_layer.items()):
        kind = "attention" if "attention" in chosen else "deltanet"
        rows.append(
            f"| {layer} | {chosen.get('experts', '-')} | {chosen.get('shared', '-')} | "
            f"{chosen.get(kind, '-')} ({kind}) |"
        )
    return rows


def _precision_rows(options: QuantizeOptions) -> list[str]:
    rows = ["| weights | precision | why |", "|---|---|---|"]
    rows.append(
        f"| routed experts | NVFP4: E2M1 values, an FP8-E4M3 scale per 16, an FP32 global scale; calibrated "
        f"input scales | {WHY['experts']} |"
    )
    if options.target is not None:
        rows.append(
            "| shared experts, attention, Gated DeltaNet projections | per layer, bf16, FP8 or NVFP4 as the "
            "search chose (table below) | the fewest bytes within the stated quality target |"
        )
    for option in options.quantize_extra:
        group, algo = arch.split(option)
        what = "FP8-E4M3, one scale per tensor" if algo == "fp8" else "NVFP4, as the experts"
        rows.append(f"| {WHY[group]} | {what} | chosen with --quantize {option} |")
    rows.append(
        "| everything else: attention and Gated DeltaNet not listed above, routers, norms, embeddings, lm_head, "
        "vision tower, MTP head | bf16, copied unchanged | small next to the experts and sensitive: "
        "quantizing them costs more quality than it saves |"
    )
    return rows


def write_card(
    tmp: Path,
    src: Path,
    dst: Path,
    options: QuantizeOptions,
    report: QuantizeReport,
    inspect_table: str,
    config: dict,
    has_vision: bool,
) -> None:
    """``README.md`` in the output being written (``tmp``, renamed to ``dst`` with the rest)."""
    name = dst.name
    base = base_model(src, config, options.base_model)
    source = f"[{base}](https://huggingface.co/{base})" if base else f"`{src.resolve().name}`"
    fallbacks = report.fallback_experts
    shown = ", ".join(f"layer {layer} expert {e}" for layer, e in fallbacks[:20])
    vllm = vllm_serve_command(name, config, served_model_name=name)
    kv = (
        "fp8, with per-layer key/value scales calibrated on the same text (amax / 448)"
        if options.kv_cache_quant_algo
        else "not quantized in the checkpoint (serve with `--kv-cache-dtype fp8` for an fp8 cache at scale 1.0)"
    )
    text = [
        _front_matter(src, config, options, has_vision),
        "",
        f"# {name}",
        "",
        f"An NVFP4 build of {source} for "
        f"stock vLLM, made by fp4moe {__version__} (`{options.format.value}` format). Only the routed experts "
        "change (and the groups listed below); everything else is the source's own bf16 bytes.",
        "",
        "## What is stored in which precision",
        "",
        *_precision_rows(options),
        "",
        "## Recipe",
        "",
        f"- Block scales: `{options.scale_method.value}`: {SCALE_METHODS[options.scale_method.value]}.",
        "- GPTQ: "
        + (
            "on: each expert's weights quantized column by column with earlier columns' rounding error folded "
            "in, from the input second moments of the tokens routed to it"
            + (" -- in the layers where the format search chose it (its table)" if options.target else "")
            if options.gptq
            else "off (round each block on its own)"
        )
        + ".",
        f"- Mix: experts{''.join(', ' + o for o in options.quantize_extra)}"
        + (", the rest per layer as searched (below)" if options.target is not None else "")
        + ".",
        f"- KV cache: {kv}.",
        f"- Calibration text: {report.calibration}; {report.calibration_tokens:,} tokens "
        f"({options.num_samples} sequences of {options.seq_len}, seed {options.seed}), run on {report.device} "
        f"in {report.calib_dtype}.",
        f"- Experts calibrated from routed tokens: {report.experts_calibrated} of {report.experts_quantized} "
        f"(fewest tokens for one: {report.min_tokens_per_expert}); fallback experts (no calibration token: input "
        f"scales from the layer's MoE input): {len(fallbacks)}" + (f" ({shown}{' ...' if len(fallbacks) > 20 else ''})" if fallbacks else "") + ".",
        "",
        *([*search_section(report.search), ""] if report.search else []),
        "To rebuild it (the recipe is also in `hf_quant_config.json` under `fp4moe_recipe` for the ModelOpt format"
        + ("; `--sensitivity` reads the table stored in this folder: write to a new DST or add --overwrite"
           if report.search else "")
        + "):",
        "",
        "```bash",
        command_line(src, dst, options),
        "```",
        "",
        "## Size",
        "",
        f"{_size(report.bytes_in)} of bf16 weights -> {_size(report.bytes_out)} "
        f"({report.bytes_out / max(report.bytes_in, 1):.1%}).",
        "",
        "## Checked",
        "",
        "`fp4moe inspect` against the bf16 source (every expert, scale and config entry; nothing else changed):",
        "",
        "```",
        inspect_table,
        "```",
        "",
        "## Serve",
        "",
        "vLLM (the reference recipe: fp8 KV cache, YaRN to twice the native context, MTP speculation, reasoning and "
        "tool-call parsers):",
        "",
        "```bash",
        shlex.join(vllm),
        "```",
        "",
        "fp4moe's own engine (one GPU, OpenAI-compatible API on 127.0.0.1:8000):",
        "",
        "```bash",
        f"fp4moe serve {shlex.quote(name)} --reasoning-parser qwen3 --tool-call-parser qwen3_coder "
        "--enable-auto-tool-choice",
        "```",
        "",
        "## Quality",
        "",
        QUALITY_BEGIN,
        f"Not measured yet: `fp4moe eval {shlex.quote(name)} --ref SOURCE --card` writes the table here.",
        QUALITY_END,
        "",
    ]
    (tmp / CARD_NAME).write_text("\n".join(text), encoding="utf-8")


def replace_quality(card: Path, table: str) -> None:
    """Put ``table`` between the card's quality markers (appended with them where the card has none),
    written to a temporary file and renamed."""
    text = card.read_text(encoding="utf-8") if card.exists() else ""
    block = f"{QUALITY_BEGIN}\n{table.rstrip()}\n{QUALITY_END}"
    if QUALITY_BEGIN in text and QUALITY_END in text:
        head, rest = text.split(QUALITY_BEGIN, 1)
        text = head + block + rest.split(QUALITY_END, 1)[1]
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + "## Quality\n\n" + block + "\n"
    tmp = card.with_name(f".{card.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(card)

