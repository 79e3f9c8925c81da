"""``fp4moe serve``: the OpenAI-compatible server on our engine, or the vLLM command (``--engine vllm``)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fp4moe.cli.options import (
    add_engine_options,
    add_split_options,
    check_device,
    engine_config,
    limit_mm,
    positive,
)
from fp4moe.errors import UserError


def add(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="OpenAI-compatible server on our engine (or the vLLM command for the checkpoint)",
        description=(
            "Serve a qwen3_5_moe checkpoint over an OpenAI-compatible HTTP API with continuous batching: "
            "/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics. With --engine vllm, print "
            "(or --exec) the vLLM command for the checkpoint instead -- the way past one GPU. Details of every "
            "option: docs/serve.md."
        ),
    )
    p.add_argument(
        "model",
        help="checkpoint directory; with --load-format dummy also a full-size name (qwen3.5-35b-a3b, "
        "qwen3.6-35b-a3b, either with -nvfp4)",
    )
    p.add_argument(
        "--engine",
        choices=["fp4moe", "vllm"],
        default="fp4moe",
        help="serve with our engine (default) or print vLLM's command",
    )

    http = p.add_argument_group("server")
    http.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)"
    )
    http.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    http.add_argument(
        "--served-model-name", default=None, help="model name clients use (default: the directory name)"
    )
    http.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* routes")
    http.add_argument(
        "--max-waiting", type=int, default=256, help="waiting requests before answering 429 (default 256)"
    )
    http.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on a GPU, compile every kernel and capture every CUDA graph before serving (default on; "
        "--no-warmup starts faster, first requests wait)",
    )
    http.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the engine loop in its own process, away from HTTP and tokenizing (default: on for the CPU, "
        "off on a GPU)",
    )
    http.add_argument(
        "--timeout-graceful-shutdown",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT, seconds open requests may run on (default 30)",
    )

    chat = p.add_argument_group("reasoning and tools")
    chat.add_argument(
        "--reasoning-parser", choices=["qwen3"], default=None, help="split <think> into reasoning_content"
    )
    chat.add_argument("--tool-call-parser", choices=["qwen3_coder"], default=None, help="parse tool calls")
    chat.add_argument("--enable-auto-tool-choice", action="store_true", help='allow tool_choice "auto"')

    prefix = p.add_argument_group("prefix cache")
    prefix.add_argument(
        "--enable-prefix-caching",
        action="store_true",
        help="reuse attention KV and Gated DeltaNet states of repeated prompt prefixes",
    )
    prefix.add_argument(
        "--prefix-block-size", type=int, default=64, help="prefix-cache block size in tokens (default 64)"
    )
    prefix.add_argument(
        "--prefix-cache-entries", type=int, default=64, help="prefix snapshots kept, LRU (default 64)"
    )
    prefix.add_argument(
        "--prefix-cache-gib",
        type=float,
        default=16.0,
        help="host memory the prefix snapshots may hold, GiB, LRU (default 16)",
    )

    limits = p.add_argument_group("request limits", "each checked before the work it bounds; over it: a 4xx")
    limits.add_argument(
        "--allowed-media-domains",
        nargs="+",
        default=[],
        help="hosts remote image URLs may be fetched from (default: none; only data: URLs)",
    )
    limits.add_argument(
        "--max-n-sequences",
        type=positive,
        default=16384,
        help="largest `n` (choices per request) accepted (default 16384, vLLM's)",
    )
    limits.add_argument(
        "--max-prompt-chars",
        type=positive,
        default=None,
        help="characters a prompt may have before it is tokenized (default: 8 x --max-model-len)",
    )
    limits.add_argument(
        "--max-image-pixels-per-request",
        type=positive,
        default=None,
        help="pixels a request's images may decode to together, read from their headers (default: 64 Mi)",
    )
    limits.add_argument(
        "--max-image-pixels-in-flight",
        type=positive,
        default=None,
        help="pixels being decoded at once across the server; more images wait (default: 64 Mi)",
    )
    limits.add_argument(
        "--max-request-bytes",
        type=positive,
        default=None,
        help="largest request body, refused before it is parsed (default: from the prompt and image limits)",
    )
    add_engine_options(p, max_num_seqs="auto", max_num_batched_tokens="auto")

    vllm = p.add_argument_group("vLLM (--engine vllm)")
    vllm.add_argument("--exec", action="store_true", help="run vLLM's command instead of printing it")
    add_split_options(vllm, "GPUs to shard over (default 1)", when="")
    vllm.add_argument(
        "--nvlink-multicast",
        action="store_true",
        help="with --tensor-parallel-size > 1: allow NVLink multicast (NVLS; off by default: on a shared host "
        "it can take the GPUs out of service)",
    )


def vllm_without_flashinfer() -> bool:
    """vLLM installed here without flashinfer (an optional dependency on Hopper): its defaults then need the
    Triton GDN prefill and VLLM_USE_FLASHINFER_SAMPLER=0."""
    from importlib.util import find_spec

    return find_spec("vllm") is not None and find_spec("flashinfer") is None


def vllm_command(args) -> list[str]:
    """The reference recipe for stock vLLM (``models.vllm_recipe``), adapted to this checkpoint and machine."""
    from fp4moe.engine.loading.loader import load_config
    from fp4moe.models.vllm_recipe import vllm_serve_command

    k = getattr(args, "num_speculative_tokens", "auto")
    cmd = vllm_serve_command(
        args.model,
        load_config(args.model),
        served_model_name=args.served_model_name or Path(args.model).name,
        host=args.host,
        port=args.port,
        max_model_len=args.max_model_len,
        hf_overrides=json.loads(args.hf_overrides) if args.hf_overrides else None,
        limit_mm_per_prompt=limit_mm(args.limit_mm_per_prompt),
        max_num_seqs=None if args.max_num_seqs == "auto" else args.max_num_seqs,  # auto: vLLM's own default
        num_speculative_tokens=2 if k == "auto" else int(k),  # the reference recipe's n = 2; 0 turns MTP off
    )
    if (
        vllm_without_flashinfer()
    ):  # on Hopper vLLM's "auto" GDN prefill picks FlashInfer without checking for it
        cmd += ["--gdn-prefill-backend", "triton"]
    if args.tensor_parallel_size > 1:
        cmd += ["--tensor-parallel-size", str(args.tensor_parallel_size)]
        cmd += ["--enable-expert-parallel"] if args.enable_expert_parallel else []
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    if args.load_format == "dummy":
        cmd += ["--load-format", "dummy"]
    return cmd


def check_split(args) -> None:
    """Refuse a --tensor-parallel-size the checkpoint's shapes cannot be split over, with what breaks
    (``formats.sharding``), before vLLM fails in its loader."""
    from fp4moe.engine.loading.loader import load_config
    from fp4moe.formats import sharding
    from fp4moe.models.qwen3_5_moe import ModelArgs, text_config_dict

    config = load_config(args.model)
    found = sharding.problems(
        ModelArgs.from_text_config(text_config_dict(config)), args.tensor_parallel_size,
        args.enable_expert_parallel, nvfp4_experts="quantization_config" in config,
    )  # fmt: skip
    if found:
        raise ValueError(
            f"{args.model} does not split over --tensor-parallel-size {args.tensor_parallel_size}"
            f"{' with expert parallelism' if args.enable_expert_parallel else ''}: " + "; ".join(found)
        )


# NVLink multicast off in every library that would use it (the command's environment, ``vllm_env``)
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def vllm_env(args) -> dict[str, str]:
    """The environment ``vllm_command`` runs in: the FlashInfer-less sampler where FlashInfer is missing, and
    NVLink multicast off across GPUs unless ``--nvlink-multicast``."""
    env = {"VLLM_USE_FLASHINFER_SAMPLER": "0"} if vllm_without_flashinfer() else {}
    if args.tensor_parallel_size > 1 and not args.nvlink_multicast:
        env |= NO_MULTICAST
    return env


def check_port(host: str, port: int) -> None:
    """Bind ``host:port`` and let go: a port in use (or an address not of this machine) is reported before
    the model loads. A race with another program remains possible; uvicorn then reports it."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no conflict
        try:
            s.bind((host, port))
        except OSError as e:
            raise UserError(
                f"cannot listen on {host}:{port} ({e.strerror or e}); pick another --port, or stop what uses it"
            ) from None


def run(args) -> int:
    import os
    import shlex
    import shutil

    from fp4moe.engine.loading.loader import load_config
    from fp4moe.models.full_size import resolve

    if args.tensor_parallel_size < 1:
        raise ValueError(f"--tensor-parallel-size must be at least 1, got {args.tensor_parallel_size}")
    if args.tensor_parallel_size > 1 and args.engine != "vllm":
        raise ValueError("--tensor-parallel-size > 1 needs --engine vllm (fp4moe's engine runs on one GPU)")
    args.model = resolve(args.model, args.load_format)
    if args.engine == "vllm":
        check_split(args)
        cmd, env = vllm_command(args), vllm_env(args)
        if args.exec:
            if shutil.which(cmd[0]) is None:
                raise UserError(
                    "vllm is not installed here (no `vllm` on PATH): install it (pip install vllm) on the GPU "
                    "machine, or drop --exec to print the command"
                )
            check_port(args.host, args.port)
            os.execvpe(cmd[0], cmd, {**os.environ, **env})
        print(shlex.join([f"{k}={v}" for k, v in env.items()] + cmd))
        return 0
    from fp4moe.engine.front.async_engine import AsyncEngine
    from fp4moe.engine.front.process import EngineProcess, EngineSpec, start_engine
    from fp4moe.server.app import build_app
    from fp4moe.server.config import ServerConfig
    from fp4moe.server.uvicorn_server import serve

    config = engine_config(args)
    check_device(config.device)
    load_config(args.model)  # a path that is no checkpoint: one line now, not a failure in the engine's start
    check_port(args.host, args.port)  # before the model loads (minutes on a GPU), not after
    prefix = (
        (args.prefix_block_size, args.prefix_cache_entries, int(args.prefix_cache_gib * 2**30))
        if args.enable_prefix_caching
        else None
    )
    spec = EngineSpec(str(args.model), config, args.warmup, args.max_waiting, prefix)
    own = args.engine_process if args.engine_process is not None else not config.device.startswith("cuda")
    if own:
        engine = EngineProcess(spec)
    else:
        llm, core = start_engine(spec)
        engine = AsyncEngine(core, llm.prompts, llm.encode_images, llm.warmup.warm_thread)
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
            **{
                k: v
                for k, v in (
                    ("max_image_pixels_per_request", args.max_image_pixels_per_request),
                    ("max_image_pixels_in_flight", args.max_image_pixels_in_flight),
                )
                if v is not None
            },
        ),
    )
    failure = serve(app, args.host, args.port, args.timeout_graceful_shutdown)
    if failure is not None:
        print(f"fp4moe serve: error: the engine stopped ({failure}); exiting", file=sys.stderr, flush=True)
        return 1
    return 0
