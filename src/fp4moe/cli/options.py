"""What several commands share, declared once: the engine options of ``generate`` and ``serve``
(``add_engine_options``, turned into an ``EngineConfig`` by ``engine_config``), the device and load-format
options, and the exit codes."""

from __future__ import annotations

import argparse
import json

EXIT_PROBLEMS = 1  # inspect found problems


EXIT_ERROR = 2  # bad input, nothing written


def spec_tokens(value: str) -> int | str:
    """--num-speculative-tokens: a count >= 0 or "auto"."""
    if value == "auto":
        return value
    try:
        return non_negative(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of tokens or 'auto', got {value!r}") from None


def non_negative(value: str) -> int:
    """A count >= 0 (--num-speculative-tokens, --speculative-draft-vocab)."""
    n = int(value)
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or more, got {n}")
    return n


def seqs(value: str) -> int | str:
    """--max-num-seqs, --max-num-batched-tokens: a positive count or auto."""
    return "auto" if value == "auto" else positive(value)


def positive(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return n


DEVICE_HELP = (
    "auto (default: cuda when there is a GPU the engine runs on -- sm80 or later -- else cpu), cpu (the "
    "reference path) or cuda"
)


def resolve_device(value: str) -> str:
    """``--device auto`` -> cuda when torch sees one the GPU engine supports (``gpu_arch.MIN_CAPABILITY``),
    else cpu."""
    if value != "auto":
        return value
    import torch

    from fp4moe.kernels import gpu_arch

    ok = torch.cuda.is_available() and torch.cuda.get_device_capability() >= gpu_arch.MIN_CAPABILITY
    return "cuda" if ok else "cpu"


def check_device(device: str) -> None:
    """A one-line error where ``device`` (resolved) cannot run here: CUDA without a CUDA GPU, a GPU index
    past the ones torch sees, a name torch does not know. Called by each command before it loads a model."""
    from fp4moe.kernels import gpu_arch

    try:
        gpu_arch.require_device(device)
    except RuntimeError as e:  # torch.device's own complaint about the string
        raise ValueError(f"--device {device}: {e}; use auto, cpu, cuda or cuda:N") from None


def add_load_format(p) -> None:
    p.add_argument(
        "--load-format",
        choices=["auto", "safetensors", "dummy"],
        default="auto",
        help="auto/safetensors: read the checkpoint's weights; dummy: random weights from config.json alone, "
        "for speed measurements (the output is noise)",
    )


SPEC_HELP = (
    "MTP speculative decoding: tokens drafted per step by the checkpoint's MTP head (0 = off; auto: 2 on a GPU "
    "when the checkpoint has one, else 0). What it gains by batch and sampling: docs/serve.md"
)


def add_engine_options(p, max_num_seqs: int | str, max_num_batched_tokens: int | str) -> None:
    """The options of every command that runs fp4moe's engine (generate, serve): one EngineConfig, in three
    argument groups of ``p``."""
    from fp4moe.engine.front.config import AUTO_CPU_BATCHED_TOKENS, AUTO_GPU_BATCHED_TOKENS

    model = p.add_argument_group("model and precision")
    model.add_argument("--device", default="auto", help=DEVICE_HELP)
    model.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float16", "float32"],
        help="compute dtype (auto: the checkpoint's)",
    )
    add_load_format(model)
    model.add_argument(
        "--hf-overrides",
        default=None,
        help='JSON merged into config.json, e.g. YaRN: \'{"text_config": {"rope_parameters": {...}}}\'',
    )
    model.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the model's)")
    model.add_argument(
        "--limit-mm-per-prompt",
        default='{"image": 4}',
        help="most images one prompt may carry: JSON as vLLM takes it (default '{\"image\": 4}') or a count",
    )
    model.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "fp8"],
        default="auto",
        help="fp8: keys/values stored as float8-e4m3 with per-layer scales (half the cache memory of bf16)",
    )

    sched = p.add_argument_group("scheduling and memory")
    sched.add_argument(
        "--max-num-seqs",
        type=seqs,
        default=max_num_seqs,
        help=f"sequences in the running batch at most, or auto (GPU: sized by memory, up to 256; CPU: 16) "
        f"(default {max_num_seqs})",
    )
    sched.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="with --device cuda: share of GPU memory for weights + caches (default 0.9)",
    )
    sched.add_argument(
        "--max-num-batched-tokens",
        type=seqs,
        default=max_num_batched_tokens,
        help=f"tokens one step runs at most (prompt chunks and decodes), or auto: {AUTO_GPU_BATCHED_TOKENS} on "
        f"the GPU, {AUTO_CPU_BATCHED_TOKENS} on the CPU (default {max_num_batched_tokens})",
    )
    sched.add_argument(
        "--prefill-graph-tokens",
        type=positive,
        default=None,
        help="with --device cuda: rows one prefill CUDA graph holds at most (default: a step's tokens, at most "
        "8192, plus an eighth for padding)",
    )
    sched.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="split long prompts across steps to keep decoding (default on)",
    )
    sched.add_argument(
        "--max-cached-tokens",
        type=positive,
        default=None,
        help="KV budget in tokens (default: what GPU memory holds, 2^20 on the CPU); beyond it sequences are "
        "preempted and recomputed",
    )
    sched.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on the GPU: launch each decode step before the previous step's tokens are read back, as vLLM V1 "
        "does (default on)",
    )

    spec = p.add_argument_group("speculative decoding (MTP)")
    spec.add_argument("--num-speculative-tokens", type=spec_tokens, default="auto", help=SPEC_HELP)
    spec.add_argument(
        "--speculative-disable-by-batch-size",
        type=int,
        default=0,
        help="no drafts while more than this many sequences decode (0 = never, default)",
    )
    spec.add_argument(
        "--speculative-draft-vocab",
        type=non_negative,
        default=0,
        metavar="N",
        help="draft from the N lowest token ids and the special tokens only (EAGLE-3-style; outputs unchanged, "
        "a cheaper draft); 0 = the whole vocabulary (default)",
    )


def add_split_options(p, gpus_help: str, when: str = "with ") -> None:
    """How vLLM splits the model over GPUs (``serve --engine vllm`` runs it so; ``inspect`` checks the shapes
    allow it): ``gpus_help`` for the GPU count, ``when`` prefixes the expert-parallel option's help."""
    p.add_argument("--tensor-parallel-size", type=int, default=1, help=gpus_help)
    p.add_argument(
        "--enable-expert-parallel",
        action=argparse.BooleanOptionalAction,
        default=True,
        help=f"{when}--tensor-parallel-size > 1: each GPU holds whole routed experts (default on); "
        "--no-enable-expert-parallel splits every expert across the GPUs",
    )


def limit_mm(value: str) -> dict[str, int]:
    """--limit-mm-per-prompt: vLLM's JSON ({"image": 4}) or a plain count of images."""
    try:
        limits = json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"--limit-mm-per-prompt is not valid JSON or a count: {e}") from None
    limits = {"image": limits} if isinstance(limits, int) and not isinstance(limits, bool) else limits
    counts = isinstance(limits, dict) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in limits.values()
    )
    if not counts:
        raise ValueError(f"--limit-mm-per-prompt must map modalities to counts >= 0, got {value}")
    return limits


def engine_config(args):
    """The EngineConfig of the parsed engine options (``--device auto`` resolved)."""
    from fp4moe.engine.front.config import AUTO_CPU_BATCHED_TOKENS, AUTO_GPU_BATCHED_TOKENS, EngineConfig

    try:
        overrides = json.loads(args.hf_overrides) if args.hf_overrides else None
    except json.JSONDecodeError as e:
        raise ValueError(f"--hf-overrides is not valid JSON: {e}") from None
    device = resolve_device(args.device)
    tokens = args.max_num_batched_tokens
    if tokens == "auto":
        tokens = AUTO_GPU_BATCHED_TOKENS if device.startswith("cuda") else AUTO_CPU_BATCHED_TOKENS
    return EngineConfig(
        dtype=args.dtype,
        device=device,
        hf_overrides=overrides,
        max_model_len=args.max_model_len,
        limit_mm_per_prompt=limit_mm(args.limit_mm_per_prompt),
        kv_cache_dtype=args.kv_cache_dtype,
        num_speculative_tokens=args.num_speculative_tokens,
        speculative_disable_by_batch_size=args.speculative_disable_by_batch_size,
        speculative_draft_vocab=args.speculative_draft_vocab,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=tokens,
        enable_chunked_prefill=args.enable_chunked_prefill,
        max_cached_tokens=args.max_cached_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization,
        load_format=args.load_format,
        async_scheduling=args.async_scheduling,
        prefill_graph_tokens=args.prefill_graph_tokens,
    )
