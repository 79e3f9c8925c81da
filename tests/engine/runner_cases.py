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


# How far the fused path may drift from the module path, measured (2026-12-05, Triton's interpreter on this
# x86 CPU, every comparison of test_cuda_runner.py, test_cuda_spec.py and test_async_steps.py): decode steps
# after prompts through the modules moved the chosen token's logprob by at most 0.031 nats and the
# reference's top-2 gap by at most 0.031, every token identical. ``tol`` at 0.05 (1.6x). The gap's bound
# (``tie``: a token may part only where the reference's two best were closer than that) is 0.07: the logits
# are bf16, one ulp is 0.031 at |logit| in [4, 8), and two logits rounded from nearby values each move by up to
# an ulp, so their gap by up to two (0.0625). Seen on this CI's CPU with an fp8 cache (2026-12-07): gaps moved
# 0.031 wherever tokens agreed, and a token parted at a reference margin of exactly 0.0625.
DECODE = dict(tol=0.05, tie=0.07)
# The fused prefill rounds differently at one op: it sums the experts in fp32 where the modules round each
# expert's output to bf16: 0.046 nats and a gap moved by 0.047 (two splits, at margins 0.016 and 0.047). Bounds
# at 0.08 (1.7x).
FUSED_PREFILL = dict(tol=0.08, tie=0.08)
# On the GPU (cuBLAS and the compiled kernels, not the interpreter's numpy): compare's defaults, measured by
# benchmarks/decode.py's gate on the H200 (up to 0.18 nats with NVFP4 experts).
GPU = dict(tol=0.2, tie=0.1)
# The GPU with an fp8 cache (decode steps and the fused prefill): the gate measured up to 0.087 nats (bf16
# experts) and 0.101 (NVFP4 experts) on the H200; 0.15 (1.5x).
GPU_FP8 = dict(tol=0.15, tie=0.1)


def _agree(ref, got, fused_prefill: bool = False, bounds: dict | None = None):
    """Greedy agreement within the measured drift (``DECODE``, ``FUSED_PREFILL``; ``GPU`` on CUDA): tokens
    equal but where the reference's top-2 margin is below ``tie`` (the sequence's comparison ends there; its
    length is then free), chosen-token logprobs within ``tol``, and a floor on the tokens compared: as many as
    there are sequences, and half of all tokens -- or, where the reference itself has a near tie sooner, every
    token before it (``checkable``: a short run may part there on any CPU; the fused round parted at a
    0.016-nat margin after 4 of 14 tokens, a 3 + 6-token run after 2). Prints what it compared (``pytest -s``
    or a failure shows it)."""
    bounds = bounds or (GPU if DEV == "cuda" else FUSED_PREFILL if fused_prefill else DECODE)
    agree = greedy_agreement(ref, got, **bounds)
    print(f"agreement: {agree}")
    _log_drift(ref, got, agree)
    assert agree.ok, str(agree)
    assert agree.compared >= max(len(ref), min(agree.total / 2, agree.checkable)), str(agree)
    return agree


def _log_drift(ref, got, agree) -> None:
    """With FP4MOE_DRIFT_LOG=path, appends what the bounds above were measured from (one JSON line a
    comparison: worst chosen-token drift, worst top-2 gap drift, margins where sequences parted)."""
    import json
    import os

    if not os.environ.get("FP4MOE_DRIFT_LOG"):
        return
    gap_drift, split_margins = 0.0, []
    for r, g in zip(ref, got, strict=True):
        ids = list(g) if isinstance(g, list | tuple) else list(g.outputs[0].token_ids)
        lps = None if isinstance(g, list | tuple) else g.outputs[0].logprobs
        for j, step in enumerate(r.outputs[0].logprobs):
            top = sorted(step.top_logprobs.values(), reverse=True)
            if j >= len(ids) or ids[j] != step.token_id:
                split_margins.append(top[0] - top[1])
                break
            if lps:
                mine = sorted(lps[j].top_logprobs.values(), reverse=True)
                gap_drift = max(gap_drift, abs((top[0] - top[1]) - (mine[0] - mine[1])))
    line = dict(test=os.environ.get("PYTEST_CURRENT_TEST"), identical=agree.identical, compared=agree.compared,
                total=agree.total, logprob_drift=agree.max_logprob_diff, gap_drift=gap_drift,
                split_margins=split_margins)  # fmt: skip
    with open(os.environ["FP4MOE_DRIFT_LOG"], "a") as f:
        f.write(json.dumps(line) + "\n")


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
