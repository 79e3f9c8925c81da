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


def add_load_format(p) -> None:
    p.add_argument(
        "--load-format",
        choices=["auto", "safetensors", "dummy"],
        default="auto",
        help="auto/safetensors: read the checkpoint's weights; dummy (vLLM's name): build the model from "
        "config.json alone with random weights in the checkpoint's precision (no shards needed: for speed "
        "measurements at full size; the output is noise, images are refused)",
    )


SPEC_HELP = (
    "MTP speculative decoding: draft this many tokens per step with the checkpoint's MTP head and verify them "
    "(0 = off; default auto: 2 on a GPU when the checkpoint has an MTP head, else 0). On a GPU greedy requests run "
    "a fused, graph-captured round (1.4-2.2x faster decoding at 70-90%% acceptance, by batch and k; BENCHMARKS.md), "
    "sampled ones (temperature, top-k/top-p/min-p) the same round with rejection sampling on the GPU (except "
    "top-k/top-p, which decode without drafts: their round sorts each vocabulary row, 1.1x at 80%% acceptance, "
    "batch 1); requests with penalties or logprobs run an unfused round that is slower than plain decoding there; "
    "a sequence whose drafts are rarely accepted decodes plainly and re-probes now and then; on the CPU "
    "speculation does not pay (compute-bound)"
)


def add_engine_options(p, max_num_seqs: int | str, max_num_batched_tokens: int | str) -> None:
    """The options of every command that runs fp4moe's engine (generate, serve): one EngineConfig."""
    from fp4moe.engine.front.config import AUTO_CPU_BATCHED_TOKENS, AUTO_GPU_BATCHED_TOKENS

    p.add_argument("--device", default="auto", help=DEVICE_HELP)
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float16", "float32"],
        help="compute dtype (auto: the checkpoint's)",
    )
    add_load_format(p)
    p.add_argument(
        "--hf-overrides",
        default=None,
        help='JSON merged into config.json, e.g. YaRN: \'{"text_config": {"rope_parameters": {...}}}\'',
    )
    p.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the model's)")
    p.add_argument(
        "--limit-mm-per-prompt",
        default='{"image": 4}',
        help="most images one prompt may carry: JSON as vLLM takes it (default '{\"image\": 4}') or a count",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "fp8"],
        default="auto",
        help="fp8: keys/values stored as float8-e4m3 with per-layer scales (half the cache memory of bf16)",
    )
    p.add_argument(
        "--max-num-seqs",
        type=seqs,
        default=max_num_seqs,
        help=f"sequences in the running batch at most, or auto: on the GPU the largest CUDA-graph bucket (up to "
        f"256) whose per-sequence states take at most a quarter of the memory the model leaves, 16 on the CPU "
        f"(default {max_num_seqs})",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="with --device cuda: share of GPU memory for weights + caches; sizes the KV budget (default 0.9)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=seqs,
        default=max_num_batched_tokens,
        help=f"tokens one step runs at most, prompt chunks and decodes, or auto: {AUTO_GPU_BATCHED_TOKENS} on the "
        f"GPU (vLLM's server default there; 64 prompts of 512 tokens prefill in 4 steps, not 16), "
        f"{AUTO_CPU_BATCHED_TOKENS} on the CPU (default {max_num_batched_tokens})",
    )
    p.add_argument(
        "--prefill-graph-tokens",
        type=positive,
        default=None,
        help="with --device cuda: rows one prefill graph holds at most (fresh prompts x their length padded to "
        "a bucket); a step's fresh prompts replay as many graphs as they need. Larger graphs run more rows per "
        "expert and capture more graphs at start-up (default: --max-num-batched-tokens, at most 8192, and an "
        "eighth more for the prompts' padding)",
    )
    p.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="split long prompts across steps to keep decoding (default on)",
    )
    p.add_argument(
        "--max-cached-tokens",
        type=positive,
        default=None,
        help="KV budget in tokens (default: what the cache holds in GPU memory, 2^20 on the CPU); beyond it "
        "sequences are preempted and recomputed",
    )
    p.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on the GPU: launch each decode-only step (a plain step, or with speculation the next fused "
        "round) before the previous step's tokens are read back, so detokenizing, stop checks and scheduling "
        "overlap the GPU's work (vLLM V1's async scheduling; a sequence that ends on a token runs one extra "
        "row or round). Off: one step at a time (default on)",
    )
    p.add_argument("--num-speculative-tokens", type=spec_tokens, default="auto", help=SPEC_HELP)
    p.add_argument(
        "--speculative-disable-by-batch-size",
        type=int,
        default=0,
        help="with speculation: no drafts while more than this many sequences are decoding (one batched "
        "plain step is cheaper under load; the MTP head catches up afterwards). 0 = never (default)",
    )
    p.add_argument(
        "--speculative-draft-vocab",
        type=non_negative,
        default=0,
        metavar="N",
        help="with speculation: the MTP head drafts from N token ids only -- the N lowest (a byte-level BPE's "
        "most frequent) and every special token -- as EAGLE-3's draft vocabularies do: each draft reads N rows "
        "of the lm_head, not all (Qwen3.5/3.6: 1 GB per draft in bf16, 134 MB at 32768). Outputs are "
        "unchanged (the target verifies); acceptance drops where the next token lies outside the N ids. "
        "0 = the whole vocabulary (default)",
    )


def add_split_options(p, gpus_help: str, when: str = "with ") -> None:
    """How vLLM splits the model over GPUs (``serve --engine vllm`` runs it so; ``inspect`` checks the shapes
    allow it): ``gpus_help`` for the GPU count, ``when`` prefixes the expert-parallel option's help."""
    p.add_argument("--tensor-parallel-size", type=int, default=1, help=gpus_help)
    p.add_argument(
        "--enable-expert-parallel",
        action=argparse.BooleanOptionalAction,
        default=True,
        help=f"{when}--tensor-parallel-size > 1: each GPU holds whole routed experts (vLLM's expert "
        "parallelism, default on); --no-enable-expert-parallel splits every expert across the GPUs (tensor "
        "parallelism, as the rest of the model)",
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
