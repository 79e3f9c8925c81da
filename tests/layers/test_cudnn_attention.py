"""Fresh prompts' causal attention through cuDNN (GPU): padded to whole CUDNN_STEP rows, so that a server
meets a few shapes, each with its cuDNN plan built at start-up. The padding must not change the real rows:
on the CPU, the same padded call (through SDPA's math backend) against ``attend`` in fp32 (the padded rows
only add exact zeros to each real row's sums: 1e-6); on the GPU, cuDNN against flash attention within bf16
rounding (relative L2 2e-2, as the attention kernels' tests)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend

from fp4moe.layers import attention


@pytest.fixture
def cudnn_on(monkeypatch):
    monkeypatch.setattr(attention, "_cudnn_attention", lambda: True)


def test_cudnn_lengths_are_whole_steps_between_the_bounds(cudnn_on):
    step, low, high = attention.CUDNN_STEP, attention.CUDNN_MIN, attention.CUDNN_MAX
    assert attention.cudnn_length(low) == 0  # flash attention at and below the lower bound
    assert attention.cudnn_length(low + 1) == low + step
    assert attention.cudnn_length(low + step) == low + step
    assert attention.cudnn_length(8000) == 8192
    assert attention.cudnn_length(high) == high
    assert attention.cudnn_length(high + 1) == 0
    padded = {attention.cudnn_length(n) for n in range(low + 1, 8193)}
    assert len(padded) == (8192 - low) // step  # the plans warm_cudnn builds for an 8,192-token budget


@pytest.mark.parametrize(
    "extra,strided", [(77, False), (attention.CUDNN_STEP, False), (attention.CUDNN_STEP, True)]
)
def test_padded_causal_attention_is_attend_on_the_real_rows(cudnn_on, monkeypatch, extra, strided):
    """Padded rows (77 past the bound) and whole steps as they are; q strided as q_proj leaves it (the query
    half of each query/gate row) is copied in. The output keeps [tokens, heads, D] order."""
    gen = torch.Generator().manual_seed(extra)
    n, h, hkv, d = attention.CUDNN_MIN + extra, 4, 2, 16
    q, k, v = (torch.randn(n, heads, d, generator=gen) for heads in (h, hkv, hkv))
    if strided:
        q = torch.cat([q, torch.randn(n, h, d, generator=gen)], dim=-1)[..., :d]
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(
        attention.F, "scaled_dot_product_attention", lambda *a, **kw: seen.append(a[:3]) or sdpa(*a, **kw)
    )
    got = attention.causal_cudnn(q, k, v, backend=SDPBackend.MATH)
    (sq, sk, sv), whole = seen[0], n % attention.CUDNN_STEP == 0
    assert sq.shape == (1, h, attention.cudnn_length(n), d)
    # whole steps of contiguous rows go in as they are (views); padded or strided ones through one copy
    assert (sq.data_ptr() == q.data_ptr()) == (whole and not strided)
    assert (sk.data_ptr() == k.data_ptr()) == (sv.data_ptr() == v.data_ptr()) == whole
    want = attention.attend(q, k, v, 0)  # the CPU: plain causal SDPA of the n rows
    assert got.shape == want.shape == (n, h, d)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cudnn_attention_matches_flash_attention_on_the_gpu():
    gen = torch.Generator(device="cuda").manual_seed(1)
    n, h, hkv, d = 3000, 16, 2, 256  # the model's shapes; 3,000 rows pad to 3,072
    q, k, v = (torch.randn(n, heads, d, generator=gen, device="cuda", dtype=torch.bfloat16)
               for heads in (h, hkv, hkv))  # fmt: skip
    assert attention.cudnn_length(n) == 3072
    got = attention.attend(q, k, v, 0)  # cuDNN, padded
    with torch.nn.attention.sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        want = torch.nn.functional.scaled_dot_product_attention(
            *(x.transpose(0, 1)[None] for x in (q, k, v)), is_causal=True, enable_gqa=True
        )[0].transpose(0, 1)
    rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert rel < 2e-2
    q8, k8, v8 = (torch.randn(8192, heads, d, generator=gen, device="cuda", dtype=torch.bfloat16)
                  for heads in (h, hkv, hkv))  # fmt: skip
    got = attention.attend(q8, k8, v8, 0)  # a whole number of steps: no padding, no copies
    assert got.is_contiguous()  # cuDNN wrote it in q's [tokens, heads, D] order
    with torch.nn.attention.sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        want = torch.nn.functional.scaled_dot_product_attention(
            *(x.transpose(0, 1)[None] for x in (q8, k8, v8)), is_causal=True, enable_gqa=True
        )[0].transpose(0, 1)
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fresh_prompts_of_a_cudnn_length_in_a_cuda_graph():
    """``attend_fresh`` of two prompts of 2,560 rows (a prefill graph's bucket: cuDNN, unpadded), eager and
    replayed from a CUDA graph (as the prefill graphs run it, on another thread than the capture's: the
    server's engine thread), against flash attention per prompt."""
    import threading

    gen = torch.Generator(device="cuda").manual_seed(2)
    b, n, h, hkv, d = 2, 2560, 16, 2, 256
    assert attention.cudnn_length(n) == n
    q, k, v = (torch.randn(b * n, heads, d, generator=gen, device="cuda", dtype=torch.bfloat16)
               for heads in (h, hkv, hkv))  # fmt: skip
    with torch.nn.attention.sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        want = torch.cat([
            torch.nn.functional.scaled_dot_product_attention(
                *(x[i * n : (i + 1) * n].transpose(0, 1)[None] for x in (q, k, v)), is_causal=True,
                enable_gqa=True, scale=d**-0.5,
            )[0].transpose(0, 1)
            for i in range(b)
        ])  # fmt: skip
    eager = attention.attend_fresh(q, k, v, b)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attention.attend_fresh(q, k, v, b)
    q.copy_(torch.randn(q.shape, generator=gen, device="cuda", dtype=q.dtype))  # replays read the inputs
    fresh = attention.attend_fresh(q, k, v, b)
    thread = threading.Thread(target=graph.replay)
    thread.start()
    thread.join()
    torch.cuda.synchronize()
    for got, ref in ((eager, want), (out, fresh)):
        rel = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
        assert rel < 2e-2, rel
    torch.testing.assert_close(out, fresh, rtol=0, atol=0)  # the graph runs the eager call's kernel


def test_the_engine_thread_builds_its_own_cudnn_plans(checkpoints, monkeypatch):
    """cuDNN's plans are per thread: after a warm-up, the server's engine thread warms again before serving
    (``LLM.warm_thread`` at the start of ``AsyncEngine``'s loop), for the step budget the warm-up ran at."""
    import threading

    from fp4moe.engine.front.async_engine import AsyncEngine
    from fp4moe.engine.front.llm import LLM
    from fp4moe.engine.loop.scheduler import SchedulerConfig

    calls = []
    monkeypatch.setattr(
        attention, "warm_cudnn", lambda *a: calls.append((threading.current_thread().name, *a))
    )
    llm = LLM(checkpoints.bf16(), dtype="float32")
    llm.warmup.warm_thread()
    assert calls == []  # nothing before a warm-up
    llm.warmup.tokens = 4096  # as ``warmup(4096)`` leaves it (the CPU runs no warm-up)
    engine = AsyncEngine(
        llm.new_core(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=256)),
        llm.prompts,
        llm.encode_images,
        llm.warmup.warm_thread,
    )
    try:
        a = llm.model.args
        for _ in range(100):
            if calls:
                break
            threading.Event().wait(0.05)
        assert calls == [("fp4moe-engine", 4096, a.num_heads, a.num_kv_heads, a.head_dim, llm.runner.device)]
    finally:
        engine.shutdown()
