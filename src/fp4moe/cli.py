"""The ``fp4moe`` command."""

from __future__ import annotations

import argparse
import errno
import json
import sys
import tempfile
from pathlib import Path

from fp4moe import __version__

EXIT_PROBLEMS = 1  # inspect found problems
EXIT_ERROR = 2  # bad input, nothing written


def _add_quantize(sub) -> None:
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
    p.add_argument(
        "--format",
        choices=["modelopt", "compressed-tensors"],
        default="modelopt",
        help="on-disk layout: ModelOpt NVFP4 per-expert tensors (default; loads in vLLM 0.17-0.33) "
        "or compressed-tensors nvfp4-pack-quantized",
    )
    p.add_argument(
        "--calib-file", help='calibration text: a .txt file, or .jsonl with a "text" field per line'
    )
    p.add_argument(
        "--calib-dataset",
        help="calibration dataset through the `datasets` package (needs a network); "
        "'wikitext' = wikitext-2-raw-v1 train",
    )
    p.add_argument("--num-samples", type=int, default=128, help="calibration sequences (default 128)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per calibration sequence (default 512)")
    p.add_argument(
        "--calibrate-all-experts",
        action="store_true",
        help="collect statistics for every expert from every token (layer outputs stay routed "
        "as usual); no expert falls back",
    )
    p.add_argument(
        "--quantize",
        default="experts",
        metavar="GROUPS",
        help="what is quantized, comma-separated: experts (always, NVFP4), attention (q/k/v/o_proj), deltanet "
        "(in_proj_qkv+in_proj_z, out_proj), shared (shared expert), lm_head; GROUP:fp8 for per-tensor FP8 "
        "instead of NVFP4 (written as ModelOpt MIXED_PRECISION, vLLM >= 0.17). Fused groups share one global "
        "and input scale, as vLLM needs; a quantized in_proj_qkvz needs vLLM >= 0.20, lm_head >= 0.23",
    )
    p.add_argument(
        "--scale-method",
        choices=["rtn", "4over6", "mse"],
        default="mse",
        help="how block scales are chosen (routed experts and every --quantize group); default mse, which gave "
        "19%% less KL than rtn on the trained reference model (BENCHMARKS.md): rtn = round-to-nearest from the "
        "block amax (ModelOpt/llm-compressor default); 4over6 = per block, max maps to 6 or 4, whichever has the "
        "smaller error; mse = per block, the e4m3 scale of least squared error among RTN's, its 6 "
        "neighbours each side and 4-over-6's (never worse than rtn per block)",
    )
    p.add_argument(
        "--gptq",
        action="store_true",
        help="GPTQ error compensation for the routed experts: each expert's input second moments are "
        "gathered from the tokens routed to it during calibration, and every 16-column group is "
        "quantized (scales by --scale-method) with the error of earlier columns folded in; memory: one "
        "[E, H, H] fp32 matrix per layer (4.3 GB at full size); see BENCHMARKS.md for what it buys",
    )
    p.add_argument(
        "--device", default="auto", help="calibration device: auto (cuda if present), cpu, cuda, cuda:N"
    )
    p.add_argument(
        "--calib-dtype",
        default="auto",
        choices=["auto", "bfloat16", "float16", "float32"],
        help="dtype the layers run in during calibration (auto: the checkpoint's own, bf16 for the real model)",
    )
    p.add_argument("--batch-size", type=int, default=8, help="calibration sequences per forward (default 8)")
    p.add_argument(
        "--max-shard-size",
        default="2GB",
        help="largest output shard; also bounds the write buffer (default 2GB)",
    )
    p.add_argument(
        "--kv-cache-quant-algo",
        choices=["FP8"],
        default=None,
        help="declare an FP8 KV cache in the quantization config (scales are computed by the engine)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed for choosing calibration windows")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace DST if it exists (only once the new one is complete)",
    )
    p.add_argument("--report", help="also write the report as JSON to this file")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def _add_inspect(sub) -> None:
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


def _add_convert(sub) -> None:
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


def _add_demo(sub) -> None:
    p = sub.add_parser(
        "demo",
        help="end to end on a tiny built-in model: build, quantize, inspect, measure KL",
        description=(
            "Build a tiny random qwen3_5_moe checkpoint (Qwen3.5 layout: fused experts, vision tower, MTP head), "
            "quantize it to NVFP4, inspect the result and compare it with the bf16 model in transformers."
        ),
    )
    p.add_argument("--out", help="keep the checkpoints in this directory (default: a temporary one)")
    p.add_argument(
        "--format", choices=["modelopt", "compressed-tensors"], default="modelopt", help="output format"
    )


def _add_eval(sub) -> None:
    p = sub.add_parser(
        "eval",
        help="quality of a model against a reference: perplexity, KL, top-1 agreement, MTP acceptance",
        description=(
            "Run MODEL and REF (e.g. an NVFP4 checkpoint and its bf16 source) on the same held-out token "
            "windows with fp4moe's engine and report, per token over the full vocabulary: perplexity of "
            "each, KL(ref || model) mean / p99 / max, top-1 agreement, and for models with an MTP head the "
            "greedy acceptance rate of its first draft. Text: the packaged held-out split (CPython 3.11 "
            "language reference, never used for calibration) unless --text-file is given."
        ),
    )
    p.add_argument("model", help="the model to judge (checkpoint directory)")
    p.add_argument("--ref", required=True, help="the reference checkpoint (same tokenizer)")
    p.add_argument("--text-file", help="UTF-8 text to evaluate on (default: the packaged held-out split)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per window (default 512)")
    p.add_argument(
        "--limit", type=int, default=4096, help="evaluate on at most this many tokens (default 4096)"
    )
    p.add_argument("--device", default="auto", help=DEVICE_HELP)
    p.add_argument(
        "--dtype", default="auto", help="compute dtype: auto (the checkpoint's), bfloat16, float32"
    )
    p.add_argument("--json", help="also write the results as JSON to this file")


def _spec_tokens(value: str) -> int | str:
    """--num-speculative-tokens: a count >= 0 or "auto"."""
    if value == "auto":
        return value
    try:
        k = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of tokens or 'auto', got {value!r}") from None
    if k < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or more tokens, got {k}")
    return k


def _add_generate(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text with our engine from a bf16 or NVFP4 checkpoint",
        description=(
            "Load a qwen3_5_moe checkpoint (bf16 in any expert layout, or NVFP4 in ModelOpt or compressed-tensors "
            "form, experts kept packed) into fp4moe's engine and generate from a prompt. Text is streamed to stdout."
        ),
    )
    p.add_argument(
        "model",
        help="checkpoint directory; with --load-format dummy also a full-size name (qwen3.5-35b-a3b, "
        "qwen3.6-35b-a3b, or either with -nvfp4: experts in NVFP4): config and a synthetic tokenizer are "
        "written once under ~/.cache/fp4moe/full-size",
    )
    p.add_argument("prompt", help="the prompt (raw text, or a user message with --chat)")
    p.add_argument(
        "--chat", action="store_true", help="wrap the prompt as a user message with the chat template"
    )
    p.add_argument(
        "--image",
        action="append",
        default=[],
        help="image file to show the model (repeatable); implies --chat unless the prompt has placeholders",
    )
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    p.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy (default); higher = more random"
    )
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = off)")
    p.add_argument(
        "--top-p", type=float, default=1.0, help="sample among the smallest set with this much mass"
    )
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability")
    p.add_argument(
        "--repetition-penalty", type=float, default=1.0, help="penalise tokens seen in prompt/output (>1)"
    )
    p.add_argument(
        "--presence-penalty", type=float, default=0.0, help="subtract from tokens already generated"
    )
    p.add_argument(
        "--frequency-penalty", type=float, default=0.0, help="subtract per time a token was generated"
    )
    p.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    p.add_argument(
        "--stop", action="append", default=[], help="stop string (repeatable); not included in the output"
    )
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    p.add_argument(
        "--stop-token-ids",
        type=int,
        nargs="+",
        default=[],
        help="token ids that end generation (kept in the ids)",
    )
    p.add_argument(
        "--include-stop-str-in-output", action="store_true", help="keep the matched stop string in the text"
    )
    p.add_argument("--n", type=int, default=1, help="completions per prompt (printed one after another)")
    p.add_argument(
        "--logprobs", type=int, default=None, help="also print each token's log-probability and the top K"
    )
    _add_engine_options(p, max_num_seqs=64, max_num_batched_tokens=8192)  # offline: LLM's defaults


def _seqs(value: str) -> int | str:
    """--max-num-seqs, --max-num-batched-tokens: a positive count or auto."""
    return "auto" if value == "auto" else _positive(value)


def _positive(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return n


DEVICE_HELP = "auto (default: cuda when there is one, else cpu), cpu (the reference path) or cuda"


def _device(value: str) -> str:
    """``--device auto`` -> cuda when torch sees one, else cpu."""
    if value != "auto":
        return value
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _add_load_format(p) -> None:
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


def _add_engine_options(p, max_num_seqs: int | str, max_num_batched_tokens: int | str) -> None:
    """The options of every command that runs fp4moe's engine (generate, serve): one EngineConfig."""
    from fp4moe.engine.config import AUTO_CPU_BATCHED_TOKENS, AUTO_GPU_BATCHED_TOKENS

    p.add_argument("--device", default="auto", help=DEVICE_HELP)
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float16", "float32"],
        help="compute dtype (auto: the checkpoint's)",
    )
    _add_load_format(p)
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
        type=_seqs,
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
        type=_seqs,
        default=max_num_batched_tokens,
        help=f"tokens one step runs at most, prompt chunks and decodes, or auto: {AUTO_GPU_BATCHED_TOKENS} on the "
        f"GPU (vLLM's server default there; 64 prompts of 512 tokens prefill in 4 steps, not 16), "
        f"{AUTO_CPU_BATCHED_TOKENS} on the CPU (default {max_num_batched_tokens})",
    )
    p.add_argument(
        "--prefill-graph-tokens",
        type=_positive,
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
        type=_positive,
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
    p.add_argument("--num-speculative-tokens", type=_spec_tokens, default="auto", help=SPEC_HELP)
    p.add_argument(
        "--speculative-disable-by-batch-size",
        type=int,
        default=0,
        help="with speculation: no drafts while more than this many sequences are decoding (one batched "
        "plain step is cheaper under load; the MTP head catches up afterwards). 0 = never (default)",
    )


def _limit_mm(value: str) -> dict[str, int]:
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
    from fp4moe.engine.config import AUTO_CPU_BATCHED_TOKENS, AUTO_GPU_BATCHED_TOKENS, EngineConfig

    try:
        overrides = json.loads(args.hf_overrides) if args.hf_overrides else None
    except json.JSONDecodeError as e:
        raise ValueError(f"--hf-overrides is not valid JSON: {e}") from None
    device = _device(args.device)
    tokens = args.max_num_batched_tokens
    if tokens == "auto":
        tokens = AUTO_GPU_BATCHED_TOKENS if device.startswith("cuda") else AUTO_CPU_BATCHED_TOKENS
    return EngineConfig(
        dtype=args.dtype,
        device=device,
        hf_overrides=overrides,
        max_model_len=args.max_model_len,
        limit_mm_per_prompt=_limit_mm(args.limit_mm_per_prompt),
        kv_cache_dtype=args.kv_cache_dtype,
        num_speculative_tokens=args.num_speculative_tokens,
        speculative_disable_by_batch_size=args.speculative_disable_by_batch_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=tokens,
        enable_chunked_prefill=args.enable_chunked_prefill,
        max_cached_tokens=args.max_cached_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization,
        load_format=args.load_format,
        async_scheduling=args.async_scheduling,
        prefill_graph_tokens=args.prefill_graph_tokens,
    )


def _add_serve(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="OpenAI-compatible server on our engine (or the vLLM command for the checkpoint)",
        description=(
            "Serve a qwen3_5_moe checkpoint over an OpenAI-compatible HTTP API with continuous batching: "
            "/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics. With --engine vllm, print "
            "(or --exec) the vLLM command for the checkpoint instead -- the way past one GPU."
        ),
    )
    p.add_argument(
        "model",
        help="checkpoint directory; with --load-format dummy also a full-size name (qwen3.5-35b-a3b, "
        "qwen3.6-35b-a3b, or either with -nvfp4: experts in NVFP4): config and a synthetic tokenizer are "
        "written once under ~/.cache/fp4moe/full-size",
    )
    p.add_argument(
        "--engine",
        choices=["fp4moe", "vllm"],
        default="fp4moe",
        help="serve with our engine or print vLLM's command",
    )
    p.add_argument(
        "--exec", action="store_true", help="with --engine vllm: run the command instead of printing it"
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)"
    )
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument(
        "--served-model-name", default=None, help="model name clients use (default: the directory name)"
    )
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* routes")
    p.add_argument(
        "--max-waiting", type=int, default=256, help="waiting requests before answering 429 (default 256)"
    )
    p.add_argument(
        "--enable-prefix-caching",
        action="store_true",
        help="reuse attention KV and Gated DeltaNet states of repeated prompt prefixes (block snapshots)",
    )
    p.add_argument(
        "--prefix-block-size", type=int, default=64, help="prefix-cache block size in tokens (default 64)"
    )
    p.add_argument(
        "--allowed-media-domains",
        nargs="+",
        default=[],
        help="hosts remote image URLs may be fetched from (default: none; only data: URLs)",
    )
    p.add_argument(
        "--prefix-cache-entries", type=int, default=64, help="prefix snapshots kept, LRU (default 64)"
    )
    p.add_argument(
        "--prefix-cache-gib",
        type=float,
        default=16.0,
        help="host memory the prefix snapshots may hold, GiB, LRU (default 16; a 512K-token prompt's snapshot "
        "of the full-size model takes 5.5 GiB with an fp8 cache; a prompt whose snapshot alone is larger takes none)",
    )
    p.add_argument(
        "--max-n-sequences",
        type=_positive,
        default=16384,
        help="largest `n` (choices per request) accepted; more is a 400 (default 16384, vLLM's)",
    )
    p.add_argument(
        "--max-prompt-chars",
        type=_positive,
        default=None,
        help="characters a prompt may have before it is tokenized; more is a 400 without tokenizing "
        "(default: 8 x --max-model-len)",
    )
    p.add_argument(
        "--max-request-bytes",
        type=_positive,
        default=None,
        help="largest request body; more is a 413 before it is parsed (default: 4 bytes per prompt character "
        "allowed, the images --limit-mm-per-prompt allows as base64 at 20 MB each, and 1 MiB)",
    )
    p.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on a GPU, compile every kernel variant and capture every CUDA graph before serving, so no "
        "request waits for them (default on; --no-warmup starts faster)",
    )
    p.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the engine loop in its own process: HTTP, tokenizing, detokenizing, stop strings, parsers "
        "and SSE stay in this one and never take the engine's GIL (vLLM V1's engine core). Default: on for "
        "the CPU (torch's OpenMP threads run the engine's ops ~5x slower from a secondary thread than from a "
        "process's main thread), off on a GPU (there the GPU bounds a step: the same tokens/s as a thread, "
        "with slower synchronous steps in the child process; BENCHMARKS.md)",
    )
    p.add_argument(
        "--timeout-graceful-shutdown",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT, seconds open requests may run on; those still running 2 s before the end "
        "are stopped (streams: an error event and [DONE]; others: 503) (default 30)",
    )
    p.add_argument(
        "--reasoning-parser", choices=["qwen3"], default=None, help="split <think> into reasoning_content"
    )
    p.add_argument("--tool-call-parser", choices=["qwen3_coder"], default=None, help="parse tool calls")
    p.add_argument("--enable-auto-tool-choice", action="store_true", help='allow tool_choice "auto"')
    _add_engine_options(p, max_num_seqs="auto", max_num_batched_tokens="auto")
    p.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="with --engine vllm: GPUs to shard over"
    )


def _add_bench(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="measure any OpenAI-compatible server: throughput vs concurrency, TTFT, spec-decode acceptance",
        description=(
            "Drive an OpenAI-compatible server (fp4moe, vLLM, SGLang, llama.cpp) with concurrent streaming "
            "requests of real text and report TTFT, prefill tok/s, per-request, aggregate and steady (while the "
            "whole round decodes) decode tok/s, latency "
            "percentiles and speculative-decoding acceptance (from /metrics): a markdown table, JSON and a PNG."
        ),
    )
    p.add_argument(
        "--base-url", required=True, help="the server's OpenAI base URL, e.g. http://127.0.0.1:8000/v1"
    )
    p.add_argument("--model", default=None, help="model name (default: the first one /v1/models lists)")
    p.add_argument("--api-key", default=None, help="bearer token, if the server wants one")
    p.add_argument("--pp", type=int, nargs="+", default=[512], help="prompt sizes in tokens (default 512)")
    p.add_argument("--tg", type=int, nargs="+", default=[128], help="tokens to generate (default 128)")
    p.add_argument(
        "--depth",
        type=int,
        nargs="+",
        default=[0],
        help="context already in the prompt before pp (default 0)",
    )
    p.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=[1, 4, 8, 16],
        help="simultaneous requests (default 1 4 8 16)",
    )
    p.add_argument("--runs", type=int, default=3, help="rounds per setting; medians are reported (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up requests before measuring (default 1)")
    p.add_argument(
        "--prompt-file", default=None, help="text to draw prompts from (default: packaged held-out docs)"
    )
    p.add_argument(
        "--chars-per-token", type=float, default=4.0, help="text length per prompt token (default 4)"
    )
    p.add_argument("--out", default="bench-results", help="directory for bench.md, bench.json, bench.png")
    p.add_argument(
        "--allow-prefix-hits",
        action="store_true",
        help="do not give each prompt a unique prefix (by default no request can hit a prefix cache)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fp4moe", description="NVFP4 for fused-expert MoE models (qwen3_5_moe)."
    )
    parser.add_argument("--version", action="version", version=f"fp4moe {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_quantize(sub)
    _add_inspect(sub)
    _add_convert(sub)
    _add_generate(sub)
    _add_serve(sub)
    _add_bench(sub)
    _add_demo(sub)
    _add_eval(sub)
    return parser


def cmd_quantize(args) -> int:
    from fp4moe.quantize.pipeline import QuantizeOptions, quantize

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
        kv_cache_quant_algo=args.kv_cache_quant_algo,
        overwrite=args.overwrite,
        seed=args.seed,
        progress=not args.no_progress,
    )
    report = quantize(args.src, args.dst, options)
    print(report.summary())
    if args.report:
        Path(args.report).write_text(report.to_json() + "\n")
    return 0


def cmd_inspect(args) -> int:
    from fp4moe.formats.checkpoint import CheckpointReader
    from fp4moe.quantize.inspect import inspect_checkpoint

    reference = CheckpointReader(args.reference) if args.reference else None
    report = inspect_checkpoint(args.path, reference=reference)
    print(report.to_json() if args.json else report.table())
    return 0 if report.ok else EXIT_PROBLEMS


def cmd_convert(args) -> int:
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


def cmd_demo(args) -> int:
    import torch

    from fp4moe.models.tiny import write_tiny_checkpoint
    from fp4moe.quantize.inspect import inspect_checkpoint
    from fp4moe.quantize.pipeline import QuantizeOptions, quantize
    from fp4moe.quantize.quality import compare_with_reference

    with tempfile.TemporaryDirectory(prefix="fp4moe-demo-") as tmp:
        root = Path(args.out) if args.out else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        src, dst = root / "tiny-bf16", root / f"tiny-nvfp4-{args.format}"
        print(f"1. building a tiny random qwen3_5_moe checkpoint in {src}")
        write_tiny_checkpoint(src)
        print("2. quantizing the routed experts to NVFP4")
        report = quantize(
            src, dst, QuantizeOptions(format=args.format, num_samples=16, seq_len=128, overwrite=True)
        )
        print(report.summary())
        print("3. inspecting the result")
        print(inspect_checkpoint(dst).table())
        print("4. transformers on the dequantized NVFP4 experts vs the bf16 model (64 held-out tokens x 4)")
        from transformers import AutoTokenizer

        from fp4moe.data import corpus_text

        tok = AutoTokenizer.from_pretrained(str(src))
        ids = tok(corpus_text("heldout")[:20000])["input_ids"]
        batch = torch.tensor([ids[i * 64 : (i + 1) * 64] for i in range(4)])
        kl = compare_with_reference(dst, src, batch)
        print(
            f"   mean KL {kl.mean_kl:.5f} nats/token, max {kl.max_kl:.5f}, top-1 agreement {kl.top1_agreement:.1%}"
        )
        print(
            "5. generating from the NVFP4 checkpoint with fp4moe's engine (experts kept packed; random weights,"
        )
        print("   so the text is noise -- the point is the path: load, prefill, decode, detokenize)")
        from fp4moe.engine.llm import LLM
        from fp4moe.engine.sampler import SamplingParams

        llm = LLM(dst)
        out = llm.chat(
            [{"role": "user", "content": "What is a list comprehension?"}],
            SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
        )[0].outputs[0]
        print(f"   {len(out.token_ids)} tokens: {out.text!r}")
        if args.out:
            print(f"checkpoints kept in {root}")
    return 0


def cmd_generate(args) -> int:

    from fp4moe.engine.llm import LLM
    from fp4moe.engine.sampler import SamplingParams
    from fp4moe.models.full_size import resolve

    args.model = resolve(args.model, args.load_format)
    config = engine_config(args)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        stop_token_ids=args.stop_token_ids,
        include_stop_str_in_output=args.include_stop_str_in_output,
        n=args.n,
        logprobs=args.logprobs,
    )
    llm = LLM(args.model, config)
    if args.image and "<|image_pad|>" not in args.prompt:
        content = [
            *({"type": "image", "image": f} for f in args.image),
            {"type": "text", "text": args.prompt},
        ]
        prompt = {
            "prompt": llm.apply_chat_template([{"role": "user", "content": content}]),
            "multi_modal_data": {"image": args.image},
        }
    elif args.chat:
        prompt = llm.apply_chat_template([{"role": "user", "content": args.prompt}])
    else:
        prompt = (
            {"prompt": args.prompt, "multi_modal_data": {"image": args.image}} if args.image else args.prompt
        )
    if args.n == 1 and args.logprobs is None:
        for delta in llm.stream(prompt, params):
            print(delta, end="", flush=True)
        print()
        return 0
    for out in llm.generate(prompt, params)[0].outputs:
        if args.n > 1:
            print(f"--- completion {out.index} ({out.finish_reason}) ---")
        print(out.text)
        for r in out.logprobs or []:
            top = ", ".join(
                f"{llm.tokenizer.decode([t])!r}: {lp:.3f}" for t, lp in (r.top_logprobs or {}).items()
            )
            print(f"  {r.token_id:>7} {llm.tokenizer.decode([r.token_id])!r:<16} {r.logprob:8.3f}   [{top}]")
    return 0


def vllm_without_flashinfer() -> bool:
    """vLLM installed here without flashinfer (an optional dependency on Hopper): its defaults then need the
    Triton GDN prefill and VLLM_USE_FLASHINFER_SAMPLER=0."""
    from importlib.util import find_spec

    return find_spec("vllm") is not None and find_spec("flashinfer") is None


def vllm_command(args) -> list[str]:
    """The reference recipe for stock vLLM, adapted to this checkpoint."""
    from pathlib import Path

    from fp4moe.engine.loader import load_config, text_config_of

    config = load_config(args.model)
    text = text_config_of(config)
    name = args.served_model_name or Path(args.model).name
    rope = dict(text.get("rope_parameters") or {})
    yarn = {
        "text_config": {
            "rope_parameters": {
                **rope,
                "rope_type": "yarn",
                "factor": 2.0,
                "original_max_position_embeddings": text.get("max_position_embeddings", 262144),
            },
            "max_position_embeddings": 2 * int(text.get("max_position_embeddings", 262144)),
        }
    }
    cmd = [
        "vllm",
        "serve",
        str(args.model),
        "--served-model-name",
        name,
        "--host",
        args.host,
        "--port",
        str(args.port),
        "--kv-cache-dtype",
        "fp8",
        "--max-model-len",
        str(args.max_model_len or yarn["text_config"]["max_position_embeddings"]),
        "--hf-overrides",
        json.dumps(args.hf_overrides and json.loads(args.hf_overrides) or yarn),
        "--reasoning-parser",
        "qwen3",
        "--tool-call-parser",
        "qwen3_coder",
        "--enable-auto-tool-choice",
        "--enable-prefix-caching",
        "--enable-chunked-prefill",
        "--limit-mm-per-prompt",
        json.dumps(_limit_mm(args.limit_mm_per_prompt)),
    ]
    if args.max_num_seqs != "auto":  # auto: vLLM's own default, bounded by its KV cache
        cmd += ["--max-num-seqs", str(args.max_num_seqs)]
    k = getattr(args, "num_speculative_tokens", "auto")
    k = 2 if k == "auto" else int(k)  # the reference recipe's n = 2; 0 turns MTP off
    if k and int(text.get("mtp_num_hidden_layers", 0) or 0) > 0:
        cmd += ["--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": k})]
    if (
        vllm_without_flashinfer()
    ):  # on Hopper vLLM's "auto" GDN prefill picks FlashInfer without checking for it
        cmd += ["--gdn-prefill-backend", "triton"]
    if args.tensor_parallel_size > 1:
        cmd += ["--tensor-parallel-size", str(args.tensor_parallel_size), "--enable-expert-parallel"]
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    if args.load_format == "dummy":
        cmd += ["--load-format", "dummy"]
    return cmd


def cmd_serve(args) -> int:
    import os
    import shlex
    from pathlib import Path

    from fp4moe.models.full_size import resolve

    args.model = resolve(args.model, args.load_format)
    if args.engine == "vllm":
        cmd = vllm_command(args)
        env = {"VLLM_USE_FLASHINFER_SAMPLER": "0"} if vllm_without_flashinfer() else {}
        if args.exec:
            os.execvpe(cmd[0], cmd, {**os.environ, **env})
        print(shlex.join([f"{k}={v}" for k, v in env.items()] + cmd))
        return 0
    from fp4moe.engine.core import AsyncEngine
    from fp4moe.engine.process import EngineProcess, EngineSpec, start_engine
    from fp4moe.server.app import ServerConfig, build_app
    from fp4moe.server.uvicorn_server import serve

    config = engine_config(args)
    prefix = (
        (args.prefix_block_size, args.prefix_cache_entries, int(args.prefix_cache_gib * 2**30))
        if args.enable_prefix_caching
        else None
    )
    spec = EngineSpec(str(args.model), config, args.warmup, args.max_waiting, prefix)
    own = args.engine_process if args.engine_process is not None else not config.device.startswith("cuda")
    engine = EngineProcess(spec) if own else AsyncEngine(start_engine(spec)[1])
    where = f"in its own process (pid {engine.pid})" if own else "on a thread of the server"
    print(f"fp4moe serve: the engine loop runs {where}", file=sys.stderr, flush=True)
    app = build_app(
        engine,
        ServerConfig(
            served_model_name=args.served_model_name or Path(args.model).name,
            api_key=args.api_key,
            reasoning_parser=args.reasoning_parser,
            tool_call_parser=args.tool_call_parser,
            enable_auto_tool_choice=args.enable_auto_tool_choice,
            allowed_media_domains=frozenset(args.allowed_media_domains),
            max_n_sequences=args.max_n_sequences,
            max_prompt_chars=args.max_prompt_chars,
            max_request_bytes=args.max_request_bytes,
        ),
    )
    serve(app, args.host, args.port, args.timeout_graceful_shutdown)
    return 0


def cmd_bench(args) -> int:
    import asyncio
    from pathlib import Path

    from tqdm.auto import tqdm

    from fp4moe.bench.client import BenchConfig, rounds_json, run_bench, summarize
    from fp4moe.bench.report import markdown, write_outputs
    from fp4moe.data import corpus_text

    text = Path(args.prompt_file).read_text() if args.prompt_file else corpus_text("heldout")
    cfg = BenchConfig(
        base_url=args.base_url,
        model=args.model,
        api_key=args.api_key,
        pp=args.pp,
        tg=args.tg,
        depth=args.depth,
        concurrency=args.concurrency,
        runs=args.runs,
        warmup=args.warmup,
        chars_per_token=args.chars_per_token,
        prompt_text=text,
        allow_prefix_hits=args.allow_prefix_hits,
    )
    total = len(args.pp) * len(args.tg) * len(args.depth) * sum(args.concurrency) * args.runs
    with tqdm(total=total, desc="requests", unit="req", disable=args.no_progress) as bar:
        rounds = asyncio.run(run_bench(cfg, progress=bar.update))
    rows = summarize(rounds)
    paths = write_outputs(rows, rounds_json(rounds), Path(args.out))
    print(markdown(rows))
    print(f"\nwrote {paths['markdown']}, {paths['json']}, {paths['png']}")
    return 0 if all(r["errors"] == 0 for r in rows) else 1


def cmd_eval(args) -> int:
    from fp4moe.eval.quality import evaluate

    text = Path(args.text_file).read_text(encoding="utf-8") if args.text_file else None
    result = evaluate(
        args.model,
        args.ref,
        text,
        seq_len=args.seq_len,
        limit=args.limit,
        device=_device(args.device),
        dtype=args.dtype,
    )
    print(result.table())
    if args.json:
        tmp = Path(args.json).with_suffix(".tmp-json")
        tmp.write_text(result.to_json() + "\n")
        tmp.replace(args.json)
    return 0


COMMANDS = {
    "quantize": cmd_quantize,
    "inspect": cmd_inspect,
    "convert": cmd_convert,
    "generate": cmd_generate,
    "serve": cmd_serve,
    "bench": cmd_bench,
    "demo": cmd_demo,
    "eval": cmd_eval,
}


def main(argv: list[str] | None = None) -> int:
    from fp4moe.errors import USER_ERRORS

    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except USER_ERRORS as e:
        print(f"fp4moe {args.command}: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except OSError as e:
        if e.errno == errno.ENOSPC:
            print(f"fp4moe {args.command}: error: {e.strerror or e}; nothing was written", file=sys.stderr)
            return EXIT_ERROR
        raise
    except KeyboardInterrupt:
        print(f"fp4moe {args.command}: interrupted; nothing was written", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
