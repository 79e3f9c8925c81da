"""``fp4moe quantize``: a bf16 checkpoint to calibrated NVFP4 experts."""

from __future__ import annotations

from pathlib import Path


def add(sub) -> None:
    p = sub.add_parser(
        "quantize",
        help="NVFP4-quantize the routed experts of a bf16 qwen3_5_moe checkpoint",
        description=(
            "Calibrate and quantize the routed experts of a bf16 qwen3_5_moe checkpoint (Qwen3.5/3.6-35B-A3B) "
            "to NVFP4, one decoder layer at a time; everything else (attention, Gated DeltaNet, shared experts, "
            "routers, embeddings, lm_head, vision tower, MTP head) is copied verbatim in bf16. The output loads "
            "in stock vLLM. It is written to a temporary directory beside DST and renamed only after it passes "
            "`fp4moe inspect`."
        ),
    )
    p.add_argument("src", help="bf16 checkpoint directory (config.json, *.safetensors, tokenizer)")
    p.add_argument("dst", help="output directory (must not exist unless --overwrite)")
    what = p.add_argument_group("what is quantized and how (details: docs/quantize.md)")
    calib = p.add_argument_group("calibration")
    out = p.add_argument_group("output and run")
    out.add_argument(
        "--format",
        choices=["modelopt", "compressed-tensors"],
        default="modelopt",
        help="on-disk layout: ModelOpt NVFP4 per-expert tensors (default; loads in vLLM 0.17-0.33) "
        "or compressed-tensors nvfp4-pack-quantized",
    )
    calib.add_argument(
        "--calib-file", help='calibration text: a .txt file, or .jsonl with a "text" field per line'
    )
    calib.add_argument(
        "--calib-dataset",
        help="calibration dataset through the `datasets` package (needs a network); "
        "'wikitext' = wikitext-2-raw-v1 train",
    )
    calib.add_argument("--num-samples", type=int, default=128, help="calibration sequences (default 128)")
    calib.add_argument("--seq-len", type=int, default=512, help="tokens per calibration sequence (default 512)")
    calib.add_argument(
        "--calibrate-all-experts",
        action="store_true",
        help="collect statistics for every expert from every token (layer outputs stay routed "
        "as usual); no expert falls back",
    )
    what.add_argument(
        "--quantize",
        default="experts",
        metavar="GROUPS",
        help="comma-separated: experts (always, NVFP4), attention, deltanet, shared, lm_head; GROUP:fp8 for FP8 "
        "instead of NVFP4 (e.g. attention:fp8,deltanet:fp8,shared:fp8, the fast mix)",
    )
    what.add_argument(
        "--scale-method",
        choices=["rtn", "4over6", "mse"],
        default="mse",
        help="how block scales are chosen: mse (default; least squared error per block, 19%% less KL than rtn), "
        "rtn (round-to-nearest, as ModelOpt writes), 4over6",
    )
    what.add_argument(
        "--gptq",
        action="store_true",
        help="GPTQ error compensation for the routed experts (9%% less KL than mse alone on the reference "
        "model; needs calibration text like your use; 4.3 GB more memory a layer at full size)",
    )
    searching = p.add_argument_group(
        "format search: the smallest build within a quality target (docs/quantize.md, 'Searching formats')"
    )
    search = searching.add_mutually_exclusive_group()
    search.add_argument(
        "--budget",
        metavar="kl=X",
        help="per layer, bf16/FP8/NVFP4 for the shared expert, attention and DeltaNet projections (experts "
        "NVFP4): the fewest bytes whose predicted mean KL against bf16 (nats/token) is at most X",
    )
    search.add_argument(
        "--target-bytes",
        metavar="N",
        help="instead: the least predicted KL within N bytes of tensors (e.g. 18GB, 1 GB = 2^30 bytes; fp8 KV scales, "
        "8 bytes an attention layer, not counted); at least the all-NVFP4 size",
    )
    search.add_argument(
        "--target-bpw",
        type=float,
        metavar="B",
        help="instead: the least predicted KL within B stored bits per searched weight (all-NVFP4 is a little over 4.5, "
        "its scales included; the error for too small a B names the least)",
    )
    searching.add_argument(
        "--sensitivity",
        metavar="PATH",
        help="search on this stored sensitivity table (an output's sensitivity.json, or the one an interrupted "
        "run saved beside DST) instead of measuring one; it must match the source and settings",
    )
    searching.add_argument(
        "--sensitivity-samples",
        type=int,
        metavar="N",
        default=8,
        help="held-out windows (of --seq-len tokens, from the tail of the calibration text) the search's KL is "
        "measured on (default 8)",
    )
    calib.add_argument(
        "--device", default="auto", help="calibration device: auto (cuda if present), cpu, cuda, cuda:N"
    )
    calib.add_argument(
        "--calib-dtype",
        default="auto",
        choices=["auto", "bfloat16", "float16", "float32"],
        help="dtype the layers run in during calibration (auto: the checkpoint's own, bf16 for the real model)",
    )
    calib.add_argument("--batch-size", type=int, default=8, help="calibration sequences per forward (default 8)")
    out.add_argument(
        "--max-shard-size",
        default="2GB",
        help="largest output shard; also bounds the write buffer (default 2GB)",
    )
    what.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "fp8"],
        default="auto",
        help="fp8: calibrate per-layer k/v scales for an fp8 KV cache and write them where vLLM and fp4moe "
        "read them (default: none)",
    )
    what.add_argument(
        "--kv-cache-quant-algo",
        choices=["FP8"],
        default=None,
        help="ModelOpt's name for --kv-cache-dtype fp8",
    )
    calib.add_argument("--seed", type=int, default=0, help="seed for choosing calibration windows")
    out.add_argument(
        "--no-read-ahead",
        action="store_true",
        help="read each decoder layer only when it is quantized, not the next one ahead (slower where the "
        "disk is slow; the peak memory measured the same)",
    )
    out.add_argument(
        "--overwrite",
        action="store_true",
        help="replace DST if it exists (only once the new one is complete)",
    )
    out.add_argument(
        "--base-model",
        metavar="HUB_ID",
        help="the source's Hugging Face id for the model card's base_model (default: config.json's "
        "_name_or_path when it is one)",
    )
    out.add_argument("--report", help="also write the report as JSON to this file")
    out.add_argument("--no-progress", action="store_true", help="no progress bars")


def run(args) -> int:
    from fp4moe.quantize.options import QuantizeOptions
    from fp4moe.quantize.pipeline import quantize
    from fp4moe.quantize.search import SearchTarget

    options = QuantizeOptions(
        format=args.format,
        num_samples=args.num_samples,
        seq_len=args.seq_len,
        calib_file=args.calib_file,
        calib_dataset=args.calib_dataset,
        calibrate_all_experts=args.calibrate_all_experts,
        scale_method=args.scale_method,
        gptq=args.gptq,
        quantize_extra=args.quantize,
        device=args.device,
        calib_dtype=args.calib_dtype,
        batch_size=args.batch_size,
        max_shard_size=args.max_shard_size,
        kv_cache_quant_algo="FP8" if args.kv_cache_dtype == "fp8" else args.kv_cache_quant_algo,
        overwrite=args.overwrite,
        seed=args.seed,
        read_ahead=not args.no_read_ahead,
        progress=not args.no_progress,
        base_model=args.base_model,
        target=SearchTarget.parse(args.budget, args.target_bytes, args.target_bpw),
        sensitivity=args.sensitivity,
        sensitivity_samples=args.sensitivity_samples,
    )
    report = quantize(args.src, args.dst, options)
    print(report.summary())
    if args.report:
        Path(args.report).write_text(report.to_json() + "\n")
    return 0
