"""``fp4moe inspect``: prove a checkpoint complete and sound."""

from __future__ import annotations

from fp4moe.cli.options import (
    EXIT_PROBLEMS,
    add_split_options,
)


def add(sub) -> None:
    p = sub.add_parser(
        "inspect",
        help="validate an NVFP4 checkpoint (ours, ModelOpt's, llm-compressor's)",
        description=(
            "Check that every routed expert of every layer is NVFP4 with all scales present, typed, shaped, "
            "finite and positive; gate/up share a global scale; the exclude list names real modules and covers "
            "every bf16 linear; MTP and vision are present as configured. Exit code 1 when problems are found."
        ),
    )
    p.add_argument("path", help="checkpoint directory")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--reference", help="the bf16 source: also check nothing but the routed experts changed")
    add_split_options(
        p, "also check that vLLM can split the shapes over this many GPUs (default 1: no check)"
    )


def run(args) -> int:
    from fp4moe.formats.checkpoint import CheckpointReader
    from fp4moe.quantize.inspect import inspect_checkpoint

    reference = CheckpointReader(args.reference) if args.reference else None
    split = (args.tensor_parallel_size, args.enable_expert_parallel)
    report = inspect_checkpoint(args.path, reference=reference, split=split)
    print(report.to_json() if args.json else report.table())
    return 0 if report.ok else EXIT_PROBLEMS
