"""How the engine runs a model: one ``EngineConfig`` that ``LLM``, ``fp4moe generate`` and ``fp4moe serve``
share (the CLI declares its options once, ``cli.options.add_engine_options``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
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
    speculative_draft_vocab: int = 0  # the MTP head drafts from this many token ids (draft_vocab); 0: all
    # sequences decoding at once (the GPU runner's state slots and graph buckets); "auto": as many as GPU
    # memory holds beside the KV cache (memory.auto_max_num_seqs), AUTO_CPU_SEQS on the CPU
    max_num_seqs: int | str = 64
    max_num_batched_tokens: int = 8192  # tokens one step runs at most (prompt chunks + decodes)
    enable_chunked_prefill: bool = True  # a prompt longer than a step's room is split across steps
    max_cached_tokens: int | None = None  # KV budget in tokens; None: what the caches (GPU memory) hold
    gpu_memory_utilization: float = 0.9  # share of GPU memory for weights and caches (sizes the KV cache)
    cuda_graphs: bool = True  # capture decode steps as CUDA graphs on the GPU
    # rows one prefill graph holds at most (its prompts x their padded length): a step's fresh prompts replay
    # as many graphs as their rows need; larger graphs give the expert GEMMs more rows per expert. None: the
    # step budget, at most AUTO_PREFILL_GRAPH_TOKENS, and an eighth more for padding (``graph_rows``)
    prefill_graph_tokens: int | None = None
    # launch a decode-only step before the previous step's tokens are on the host (EngineCore.step): the
    # host's per-step work overlaps the GPU's (the GPU runner; no effect on the CPU's module path)
    async_scheduling: bool = True
    load_format: str = "auto"  # auto/safetensors: the checkpoint's weights; dummy: random, from config.json

    @property
    def graph_rows(self) -> int:
        """Rows one prefill graph holds: the set value, else a whole step's budget up to
        AUTO_PREFILL_GRAPH_TOKENS, with an eighth more for the prompts' padding to their row bucket. On the
        H100, 64 prompts of 512 tokens in 8,192-token steps prefilled in graphs of 8,192 rows gave 2,611 tok/s
        and TTFT 0.98 s, in graphs of 2,048 rows 2,257 tok/s and 1.27 s (BENCHMARKS.md, "Prefill graphs as
        large as the step"). The eighth: a step of 15 prompts of 466-530 tokens (7,808) fits one 16 x 576
        graph of 9,216 rows, where 8,192 rows took two 8 x 576 graphs and a 1 x 512 (H200: 232 ms; 16
        prompts in one 16 x 512 graph, 164 ms)."""
        if self.prefill_graph_tokens is not None:
            return self.prefill_graph_tokens
        rows = min(self.max_num_batched_tokens, AUTO_PREFILL_GRAPH_TOKENS)
        return rows + rows // 8


AUTO_CPU_SEQS = 16  # --max-num-seqs auto on the CPU
# serve's --max-num-batched-tokens auto: vLLM's server default on GPUs of this class; smaller CPU steps
AUTO_GPU_BATCHED_TOKENS, AUTO_CPU_BATCHED_TOKENS = 8192, 2048
# prefill graphs' rows at most by default: their inputs and the graph pool grow with it (8,192 measured)
AUTO_PREFILL_GRAPH_TOKENS = 8192
