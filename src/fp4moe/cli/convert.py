"""``fp4moe convert``: fused-expert NVFP4 checkpoints into the layout stock vLLM loads."""

from __future__ import annotations


def add(sub) -> None:
    p = sub.add_parser(
        "convert",
        help="rewrite fused-expert NVFP4 (needs a patched vLLM) into per-expert NVFP4 (stock vLLM)",
        description=(
            "Rewrite an NVFP4 checkpoint whose experts are fused 3-D tensors with fused scales "
            "(…experts.gate_up_proj, …gate_up_proj_weight_scale, …_weight_scale_2, …_input_scale, same for "
            "down_proj) into per-expert ModelOpt tensors. Packed bytes and block scales are copied bit for bit."
        ),
    )
    p.add_argument("src", help="fused NVFP4 checkpoint directory")
    p.add_argument("dst", help="output directory")
    p.add_argument("--max-shard-size", default="2GB", help="largest output shard (default 2GB)")
    p.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def run(args) -> int:
    from fp4moe.quantize.convert import convert

    report = convert(
        args.src,
        args.dst,
        overwrite=args.overwrite,
        max_shard_size=args.max_shard_size,
        progress=not args.no_progress,
    )
    print(report.summary())
    return 0
