"""Gated attention (full-attention layers): q_proj holds query and gate per head, q/k RMSNorm, partial
mRoPE, GQA, output * sigmoid(gate), o_proj. Attention runs per sequence over its cached keys/values."""

from __future__ import annotations

import contextlib
import functools
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from fp4moe.layers.linear import Linear
from fp4moe.layers.norm import RMSNorm
from fp4moe.layers.rope import Rotary


class GatedAttention(nn.Module):
    def __init__(
        self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, eps: float, layer_id: int
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.layer_id = layer_id
        self.q_proj = Linear(hidden, num_heads * head_dim * 2)
        self.k_proj = Linear(hidden, num_kv_heads * head_dim)
        self.v_proj = Linear(hidden, num_kv_heads * head_dim)
        self.o_proj = Linear(num_heads * head_dim, hidden)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx) -> torch.Tensor:
        """x [T, hidden] (flat batch), cos/sin [T, rotary_dim] -> [T, hidden]."""
        return self.mix(self.q_proj(x), self.k_proj(x), self.v_proj(x), cos, sin, ctx)

    def proj_sizes(self) -> list[int]:
        """The widths of q_proj's, k_proj's and v_proj's outputs, as one fused projection concatenates them."""
        return [2 * self.num_heads * self.head_dim] + [self.num_kv_heads * self.head_dim] * 2

    def mix(self, q_gate, k, v, cos, sin, ctx) -> torch.Tensor:
        """``forward`` from the projections' outputs (views of one fused projection on the GPU)."""
        q, gate, k, v = self.heads(q_gate, k, v, cos, sin)
        return self.output(ctx.kv.attend_step(self.layer_id, ctx, q, k, v), gate)

    def heads(self, q_gate, k, v, cos, sin):
        """The projections' outputs [T, ...] -> per head q (normed, rotated), gate [T, H, D] and k (normed,
        rotated), v [T, Hkv, D]."""
        t = q_gate.shape[0]
        q, gate = q_gate.reshape(t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if q.is_cuda and q.dtype == cos.dtype == torch.bfloat16:
            from fp4moe.kernels.norm import head_norm_rope, head_norm_rope_fits

            if head_norm_rope_fits(q, cos, sin) and head_norm_rope_fits(k, cos, sin):
                # one pass per token instead of the norm's fp32 chain and the rotary's products and
                # concatenations on [T, H, D] (an 8K prefill on the H200: ~7 ms of its 10 attention layers);
                # both GPU prefill paths (module, graphed prompt) take it, so they keep rounding alike (the
                # decode kernel, ``qk_norm_rope_store``, rounds the rotary once)
                q = head_norm_rope(q, self.q_norm.weight, self.q_norm.eps, cos, sin)
                k = head_norm_rope(k, self.k_norm.weight, self.k_norm.eps, cos, sin)
                return q, gate, k, v
        q = Rotary.apply(self.q_norm(q), cos, sin)
        k = Rotary.apply(self.k_norm(k), cos, sin)
        return q, gate, k, v

    def output(self, out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """Attention output [T, H, D] * sigmoid(gate), then o_proj."""
        t = out.shape[0]
        if out.is_cuda and out.dtype == gate.dtype == torch.bfloat16:
            from fp4moe.kernels.attention import output_gate

            return self.o_proj(output_gate(out, gate))  # every GPU prefill path: one pass, rounded alike
        return self.o_proj(out.reshape(t, -1) * torch.sigmoid(gate.reshape(t, -1)))


def attend_each(q: torch.Tensor, whole: list, ctx) -> torch.Tensor:
    """The step's rows q [T, H, D], each sequence's over its whole k/v (``whole``: [L, Hkv, D] pairs, as
    the caches' ``append_step`` returns them) -> [T, H, D]: the caches' ``attend_step`` where no paged
    kernel runs (the CPU; fresh prompts on the GPU)."""
    if len(whole) == 1:  # one sequence: its rows are the step's (no copy into a step buffer)
        (k, v), cached = whole[0], ctx.cached_lens[0]
        return attend(q, k, v, cached)
    out = torch.empty_like(q)
    for cached, (a, b), (k, v) in zip(ctx.cached_lens, ctx.spans(), whole, strict=True):
        out[a:b] = attend(q[a:b], k, v, cached)
    return out


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_cached: int) -> torch.Tensor:
    """Causal GQA for one sequence: q [n, H, D] at positions num_cached.., k/v [num_cached + n, Hkv, D]."""
    n, heads, dim = q.shape
    if num_cached == 0 and k.shape[0] == n:  # a fresh prompt: plain causal (flash kernels on the GPU)
        if q.is_cuda and cudnn_length(n, q.dtype):
            return causal_cudnn(q, k, v)
        # the fused kernels take 4-D [batch, heads, n, dim] only: 3-D inputs fall back to the fp32 math
        # path, which cost half of an 8K prefill on the H200 (benchmarks/decode.py); the CPU keeps 3-D
        batch = (lambda t: t.transpose(0, 1).unsqueeze(0)) if q.is_cuda else (lambda t: t.transpose(0, 1))
        out = F.scaled_dot_product_attention(
            batch(q), batch(k), batch(v), is_causal=True, scale=dim**-0.5, enable_gqa=True
        )
        return out.reshape(heads, n, dim).transpose(0, 1)
    rep = heads // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    query_pos = torch.arange(num_cached, num_cached + n, device=q.device).unsqueeze(1)
    visible = torch.arange(k.shape[0], device=q.device).unsqueeze(0) <= query_pos  # [n, L]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=visible, scale=dim**-0.5
    )
    return out.transpose(0, 1)


def attend_fresh(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: int) -> torch.Tensor:
    """Causal GQA for ``batch`` fresh prompts of equal length in consecutive rows: q [rows, H, D], k/v
    [rows, Hkv, D] -> [rows, H, D]; one batched flash-attention call on the GPU (cuDNN's where it runs the
    length, ``cudnn_length``), ``attend`` per prompt on the CPU."""
    rows, heads, dim = q.shape
    n = rows // batch
    if not q.is_cuda:
        return torch.cat([attend(q[i * n : (i + 1) * n], k[i * n : (i + 1) * n], v[i * n : (i + 1) * n], 0)
                          for i in range(batch)])  # fmt: skip
    # prompts of a length cuDNN runs at unpadded (the prefill graphs' buckets past 2,048 rows): its kernel
    cudnn = (
        sdpa_kernel(SDPBackend.CUDNN_ATTENTION) if cudnn_length(n, q.dtype) == n else contextlib.nullcontext()
    )
    with cudnn:
        out = F.scaled_dot_product_attention(
            *(x.view(batch, n, -1, dim).transpose(1, 2) for x in (q, k, v)), is_causal=True, scale=dim**-0.5,
            enable_gqa=True,
        )  # fmt: skip
    return out.transpose(1, 2).reshape(rows, heads, dim)


# Long fresh prompts on the GPU go through cuDNN's attention, padded to a whole number of CUDNN_STEP rows.
# At head dim 256 on the H200 it is twice as fast as flash attention (PyTorch's FA2 build) from 4K tokens on:
# 0.95 against 1.95 ms a layer for an 8,192-token prompt (16 q / 2 KV heads), 0.31 at 4,096
# (benchmarks/sdpa_backends.py). But cuDNN builds a plan for every new shape (~70 ms on the H200; the runner
# turns its attention off globally, since a server meets new lengths all the time): padded to multiples of
# CUDNN_STEP, lengths up to the step budget need a few plans, and ``warm_cudnn`` builds them at start-up.
# Padding rows come after every real row, so causal attention of the real rows does not see them.
CUDNN_MIN, CUDNN_STEP, CUDNN_MAX = 2048, 512, 16384


@functools.cache
def _cudnn_attention() -> bool:
    """cuDNN's attention where it was measured: Hopper (sm90) and later, cuDNN present, and not turned off
    (FP4MOE_CUDNN_ATTENTION=0: flash attention throughout, for comparisons)."""
    if os.environ.get("FP4MOE_CUDNN_ATTENTION", "1") == "0":
        return False
    return torch.backends.cudnn.is_available() and torch.cuda.get_device_capability() >= (9, 0)


def cudnn_length(n: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """The padded length cuDNN runs a fresh prompt of ``n`` rows at, or 0 where flash attention does (and for
    fp32, which cuDNN's attention does not run)."""
    if dtype == torch.float32 or not CUDNN_MIN < n <= CUDNN_MAX or not _cudnn_attention():
        return 0
    return -(-n // CUDNN_STEP) * CUDNN_STEP


def causal_cudnn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: SDPBackend = SDPBackend.CUDNN_ATTENTION
) -> torch.Tensor:
    """``attend`` of a fresh prompt q [n, H, D], k/v [n, Hkv, D] through cuDNN at ``cudnn_length(n)`` rows
    (``backend``: another SDPA backend over the same padded rows, for the CPU tests). Rows stay in
    [tokens, heads, D] order (cuDNN takes that layout and writes its output in q's): contiguous inputs of a
    whole number of CUDNN_STEP rows go in as they are, others copied once into padded rows, and the output
    needs no copy back (the [heads, tokens, D] layout cost ~1.7 ms of copies and fills an 8K prefill)."""
    n, heads, dim = q.shape
    m = cudnn_length(n)

    def padded(t: torch.Tensor) -> torch.Tensor:
        if m != n or not t.is_contiguous():
            rows = t.new_empty(m, t.shape[1], dim)
            rows[:n] = t
            rows[n:].zero_()
            t = rows
        return t.unsqueeze(0).transpose(1, 2)  # [1, heads, m, D] at [tokens, heads, D] strides

    with sdpa_kernel(backend):
        out = F.scaled_dot_product_attention(
            padded(q), padded(k), padded(v), is_causal=True, scale=dim**-0.5, enable_gqa=True
        )
    return out[0].transpose(0, 1)[:n]


def warm_cudnn(max_len: int, heads: int, kv_heads: int, dim: int, device, dtype=torch.bfloat16) -> None:
    """Build cuDNN's plans for every padded length a fresh prompt of up to ``max_len`` rows can take."""
    if device.type != "cuda":
        return
    for m in range(CUDNN_MIN + CUDNN_STEP, min(max_len, CUDNN_MAX) + CUDNN_STEP, CUDNN_STEP):
        if cudnn_length(m):
            q = torch.zeros(m, heads, dim, device=device, dtype=dtype)
            kv = torch.zeros(m, kv_heads, dim, device=device, dtype=dtype)
            causal_cudnn(q, kv, kv)
