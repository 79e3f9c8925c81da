"""How the engine runs a model: one ``EngineConfig`` that ``LLM``, ``fp4moe generate`` and ``fp4moe serve``
share (the CLI declares its options once, ``cli._add_engine_options``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class EngineConfig:
    dtype: str | torch.dtype = "auto"  # compute dtype; auto: the checkpoint's
    device: str = "cpu"  # cpu (the reference path, the torch modules) or cuda (fused kernels, CUDA graphs)
    hf_overrides: dict | None = None  # merged into config.json (e.g. YaRN rope_parameters)
    max_model_len: int | None = None  # context limit; None: the model's (YaRN-extended when overridden)
    limit_mm_per_prompt: dict[str, int] | None = None  # {"image": 4} unless set
    kv_cache_dtype: str = "auto"  # auto (the compute dtype) or fp8 (e4m3 with per-layer scales)
    num_speculative_tokens: int | str = 0  # MTP drafts per step; "auto": 2 on the GPU with an MTP head
    speculative_disable_by_batch_size: int = 0  # no drafts while more sequences than this decode; 0: never
    # sequences decoding at once (the GPU runner's state slots and graph buckets); "auto": as many as GPU
    # memory holds beside the KV cache (memory.auto_max_num_seqs), AUTO_CPU_SEQS on the CPU
    max_num_seqs: int | str = 64
    max_num_batched_tokens: int = 8192  # tokens one step runs at most (prompt chunks + decodes)
    enable_chunked_prefill: bool = True  # a prompt longer than a step's room is split across steps
    max_cached_tokens: int | None = None  # KV budget in tokens; None: what the caches (GPU memory) hold
    gpu_memory_utilization: float = 0.9  # share of GPU memory for weights and caches (sizes the KV cache)
    cuda_graphs: bool = True  # capture decode steps as CUDA graphs on the GPU
    # rows one prefill graph holds at most (its prompts x their padded length): a step's fresh prompts replay
    # as many graphs as their rows need; larger graphs give the expert GEMMs more rows per expert
    prefill_graph_tokens: int = 2048
    # launch a decode-only step before the previous step's tokens are on the host (EngineCore.step): the
    # host's per-step work overlaps the GPU's (the GPU runner; no effect on the CPU's module path)
    async_scheduling: bool = True
    load_format: str = "auto"  # auto/safetensors: the checkpoint's weights; dummy: random, from config.json


AUTO_CPU_SEQS = 16  # --max-num-seqs auto on the CPU
