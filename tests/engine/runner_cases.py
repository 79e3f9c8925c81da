"""What the GPU runner's tests share: the device (CUDA, else the CPU under Triton's interpreter), prompts, the
greedy-agreement check, a runner on the fused path, and a stand-in for CUDA graphs on the CPU."""

from __future__ import annotations

import torch

from fp4moe.engine.front.llm import LLM
from fp4moe.engine.reference.compare import greedy_agreement
from fp4moe.engine.runner.cuda_runner import CudaModelRunner
from fp4moe.engine.spec.spec_decode import MTPSpeculator

DEV = "cuda" if torch.cuda.is_available() else "cpu"
PROMPTS = [[5, 17, 300, 2, 9], list(range(40, 110)), [7]]


def _agree(ref, got, **kwargs):
    """Greedy agreement up to near ties (lengths equal unless a sequence parted at a near tie); prints what
    it compared (``pytest -s`` or a failure shows it). A comparison that ended at the first token everywhere
    would check nothing: at least one token per sequence and a third of all must have been compared (the
    tiny random model's logits are flat, so near ties are common: 1 in ~20 tokens here)."""
    agree = greedy_agreement(ref, got, **kwargs)
    print(f"agreement: {agree}")
    assert agree.ok, str(agree)
    assert agree.compared >= max(len(ref), agree.total / 3), str(agree)
    return agree


def _all_pages_back(runner) -> bool:
    """Every page is back in the pool but the scratch slot's one."""
    return runner.kv.num_free_pages == runner.kv.k.shape[1] - 1


def _fused(llm: LLM, kv_cache_dtype: str = "auto", spec_tokens: int = 0, **sizes) -> None:
    sizes = {"max_num_seqs": 4, "max_model_len": 256, **sizes}
    scales = llm.runner.kv_scales  # the CPU runner's, fixed when the LLM started (engine.loading.kv_scales)
    llm.runner = CudaModelRunner(
        llm.model, None, llm.device, kv_cache_dtype, num_pages=20, page_size=16, cuda_graphs=DEV == "cuda",
        spec_tokens=spec_tokens, **sizes,
    )  # fmt: skip
    if kv_cache_dtype == "fp8":
        llm.runner.set_kv_scales(scales)
    # prompts through the modules, so the CPU's exact comparisons see the fused decode step alone (the fused
    # prefill sums the experts in fp32, the modules in bf16: test_fused_decode_... checks it on its own)
    llm.runner.fused_prefill = False
    if spec_tokens:
        llm.speculator = MTPSpeculator(llm.model, llm.runner, llm.sampler, spec_tokens)
    elif llm.speculator is not None:  # the module-path speculator verifies on the runner it is handed
        llm.speculator.runner = llm.runner


MIXED = "attention,shared,deltanet:fp8,lm_head"  # NVFP4 and FP8 linears in the fused projections


class _Replay:
    """A stand-in CUDA graph: its replay reruns the captured function into the buffers the capture returned
    (outputs read from those buffers, refilled by every replay, as a real graph's are)."""

    def __init__(self, fn, out):
        self.fn, self.out = fn, out

    def replay(self):
        new = self.fn()
        pairs = zip(self.out, new, strict=True) if isinstance(self.out, tuple) else [(self.out, new)]
        for buf, value in pairs:
            buf.copy_(value)


def _emulate_graphs(runner) -> None:
    runner.cuda_graphs = True

    def graph_of(fn, pool=None):
        out = fn()
        return _Replay(fn, out), out

    runner.graph_of = graph_of
