"""Gated DeltaNet (linear-attention layers): projections, causal depthwise conv + SiLU with a per-sequence
conv state, the gated delta rule with a per-sequence fp32 recurrent state, gated RMSNorm, out_proj.

Per value head, with state S [Dk, Dv]:  S <- exp(g_t) S;  S <- S + k_t (beta_t (v_t - S^T k_t))^T;
o_t = S^T q_t. Prefill uses the chunked form (chunk 64), decode the token-wise recurrent form.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from fp4moe.layers.linear import Linear
from fp4moe.layers.norm import gated_rms_norm

CHUNK = 64


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def delta_rule_recurrent(q, k, v, g, beta, state):
    """Token by token. q/k [T, H, Dk], v [T, H, Dv], g/beta [T, H], state [H, Dk, Dv] (all fp32)."""
    out = torch.empty_like(v)
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, None, None]
        predicted = torch.einsum("hkv,hk->hv", state, k[t])
        state = state + k[t].unsqueeze(-1) * ((v[t] - predicted) * beta[t].unsqueeze(-1)).unsqueeze(-2)
        out[t] = torch.einsum("hkv,hk->hv", state, q[t])
    return out, state


def delta_rule_chunked(q, k, v, g, beta, state, chunk: int = CHUNK):
    """The same recurrence, ``chunk`` tokens at a time. Within a chunk with cumulative log-decay c_t and
    start state S0, the corrections u_s = beta_s (v_s - predicted_s) solve the unit lower-triangular system
    (I + A) U = beta (V - exp(c) K S0), A[s, r] = beta_s exp(c_s - c_r) k_s.k_r for r < s; then
    O = exp(c) Q S0 + (M o Q K^T) U with M[t, s] = exp(c_t - c_s) for s <= t, and
    S_end = exp(c_end) S0 + (K o exp(c_end - c))^T U."""
    total = q.shape[0]
    out = torch.empty_like(v)
    q, k, v, g, beta = (x.transpose(0, 1) for x in (q, k, v, g, beta))  # heads first: [H, T, ...]
    for start in range(0, total, chunk):
        end = min(start + chunk, total)
        qc, kc, vc, bc = q[:, start:end], k[:, start:end], v[:, start:end], beta[:, start:end]
        c = g[:, start:end].cumsum(-1)  # [H, n]
        n = end - start
        diff = c.unsqueeze(-1) - c.unsqueeze(-2)  # [H, n, n]: c_t - c_s
        lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        decay = torch.where(lower, diff, torch.full_like(diff, float("-inf"))).exp()  # M, incl. diagonal
        a = (kc @ kc.transpose(-1, -2)) * decay * bc.unsqueeze(-1)
        a = a.tril(-1)
        system = a + torch.eye(n, dtype=q.dtype, device=q.device)
        rhs = bc.unsqueeze(-1) * (vc - (c.exp().unsqueeze(-1) * kc) @ state)  # [H, n, Dv]
        u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        out[start:end] = (
            (c.exp().unsqueeze(-1) * qc) @ state + ((qc @ kc.transpose(-1, -2)) * decay) @ u
        ).transpose(0, 1)
        state = (
            c[:, -1].exp()[:, None, None] * state
            + (kc * (c[:, -1:] - c).exp().unsqueeze(-1)).transpose(-1, -2) @ u
        )
    return out, state


@functools.cache
def _fla_chunk():
    """flash-linear-attention's chunked kernel (GPU prefill), or None where fla-core is not installed. Its
    autotuners get this GPU's recorded winners first (``kernels.autotune_seeds``: a cold start compiled
    and benchmarked every config of about ten kernels, twice)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    if torch.cuda.is_available():
        from fp4moe.kernels.autotune_seeds import seed

        seed(torch.cuda.get_device_name())
    return chunk_gated_delta_rule


def _fla_rule(q, k, v, g, beta, state, normed: bool = False):
    """The chunked rule through fla on the model's own q, k, v (bf16 views of the conv output) and beta: fla
    L2-normalises q and k itself (unless ``normed``: the conv kernel did, with fla's formula) and applies the
    1/sqrt(Dk) query scale, as transformers' fla path asks it to (so the normalised q and k are rounded to bf16,
    where the CPU path and the decode kernel keep them in fp32). The decay and the state stay fp32. (Feeding
    fla fp32 q/k/v ran the rule at 1.96 ms per 8K-token layer against 0.76 in bf16 on the H200,
    benchmarks/tune/tune_prefill.py; the fp32 normalisation in torch before it was another chain of elementwise
    passes over q and k.)"""
    o, final = _fla_chunk()(
        q[None], k[None], v[None], g[None], beta[None], scale=q.shape[-1] ** -0.5,
        initial_state=state[None].contiguous(), output_final_state=True, use_qk_l2norm_in_kernel=not normed,
    )  # fmt: skip
    return o[0], final[0]


def _conv_kernel_runs(x: torch.Tensor) -> bool:
    """Whether the conv of x [n, C] runs as the GPU kernel (a bf16 prefill chunk of more than one row)."""
    return x.is_cuda and x.dtype == torch.bfloat16 and x.shape[0] > 1


def _varlen_prefill(x: torch.Tensor, ctx) -> bool:
    """Whether a step's sequences go through the rule together (a bf16 GPU step of several prompt chunks,
    fla installed) rather than one at a time. A single sequence keeps the plain call: an 8K prompt measured
    190 ms that way on the H200 against 222 through the varlen call (benchmarks/prefill_batch.py); and a
    step with a one-token row keeps them all apart, so that row takes the fp32 recurrent rule whatever
    else shares its step (a sequence's tokens must not depend on its neighbours)."""
    lens = ctx.query_lens
    return (
        x.is_cuda
        and x.dtype == torch.bfloat16
        and len(lens) > 1
        and min(lens) > 1
        and _fla_chunk() is not None
    )


class GatedDeltaNet(nn.Module):
    def __init__(
        self,
        hidden: int,
        num_k_heads: int,
        num_v_heads: int,
        k_dim: int,
        v_dim: int,
        conv_kernel: int,
        eps: float,
        layer_id: int,
    ):
        super().__init__()
        self.num_k_heads, self.num_v_heads, self.k_dim, self.v_dim = num_k_heads, num_v_heads, k_dim, v_dim
        self.layer_id, self.eps, self.conv_kernel = layer_id, eps, conv_kernel
        self.key_size, self.value_size = num_k_heads * k_dim, num_v_heads * v_dim
        self.conv_dim = 2 * self.key_size + self.value_size
        self.in_proj_qkv = Linear(hidden, self.conv_dim)
        self.in_proj_z = Linear(hidden, self.value_size)
        self.in_proj_b = Linear(hidden, num_v_heads)
        self.in_proj_a = Linear(hidden, num_v_heads)
        self.conv1d_weight = nn.Parameter(torch.empty(self.conv_dim, 1, conv_kernel), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(num_v_heads), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(num_v_heads), requires_grad=False)
        self.norm_weight = nn.Parameter(torch.empty(v_dim), requires_grad=False)
        self.out_proj = Linear(self.value_size, hidden)

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        """x [T, hidden] (flat batch) -> [T, hidden]; reads and updates each sequence's state slot."""
        return self.mix(self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x), ctx)

    def proj_sizes(self) -> list[int]:
        """The widths of in_proj_qkv's, _z's, _b's and _a's outputs, as one fused projection concatenates them."""
        return [self.conv_dim, self.value_size, self.num_v_heads, self.num_v_heads]

    def mix(self, mixed, z, b, a, ctx) -> torch.Tensor:
        """``forward`` from the projections' outputs mixed [T, conv_dim], z, b, a (views of one fused
        projection on the GPU: the conv reads rows at their stride)."""
        beta, g = self.gates(b, a)
        if _varlen_prefill(mixed, ctx):
            core = self._prefill_varlen(mixed, g, beta, ctx)
        else:
            core = self._per_sequence(mixed, g, beta, ctx)
        return self.output(core, z)

    def gates(self, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The write strength beta (sigmoid of in_proj_b's output) and the fp32 log-decay g [T, Hv]."""
        return b.sigmoid(), -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)

    def output(self, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Gated RMSNorm of the rule's output core [T, Hv, Dv] by z [T, Hv * Dv], then out_proj."""
        t = core.shape[0]
        if core.is_cuda and core.dtype == torch.bfloat16:  # one kernel instead of the fp32 elementwise chain
            from fp4moe.kernels.gdn_decode import gated_norm

            out = gated_norm(
                core.reshape(t, -1), z.reshape(t, -1), self.norm_weight, self.eps, self.num_v_heads
            )
        else:
            z = z.reshape(t, self.num_v_heads, self.v_dim)
            out = gated_rms_norm(core, z, self.norm_weight, self.eps).reshape(t, -1)
        return self.out_proj(out)

    def parts(self) -> tuple[int, int]:
        """Where the conv output's q, k and v channels split (``causal_conv``'s planar ``parts``)."""
        return self.key_size, 2 * self.key_size

    def split_qkv(self, qkv) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q, k, v) [n, width] of a conv output: [n, conv_dim] (views), or its planar parts as they are."""
        if isinstance(qkv, tuple):
            return qkv
        return qkv.split([self.key_size, self.key_size, self.value_size], dim=-1)

    def rule(self, qkv, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor, normed: bool = False):
        """The gated delta rule over one sequence's conv output qkv [n, conv_dim] (or its planar (q, k, v))
        from the fp32 state [Hv, Dk, Dv] -> (output [n, Hv, Dv] in qkv's dtype, the new state): fla's
        chunked kernel on the GPU for more than one token, else ours in fp32 (chunked; token-wise for one
        token). ``normed``: q's and k's heads are L2-normalised already (``conv_norm``)."""
        q, k, v = self.split_qkv(qkv)
        n = q.shape[0]
        q = q.view(n, self.num_k_heads, self.k_dim)
        k = k.view(n, self.num_k_heads, self.k_dim)
        v = v.view(n, self.num_v_heads, self.v_dim)
        if n > 1 and v.is_cuda and _fla_chunk() is not None:
            # grouped values: fla reads key head j // (Hv / Hk) for value head j itself
            o, new = _fla_rule(q, k, v, g, beta, state, normed)
        else:
            rep = self.num_v_heads // self.num_k_heads
            q, k = q.float(), k.float()
            if not normed:
                q, k = l2_normalize(q), l2_normalize(k)
            q = q.repeat_interleave(rep, dim=1) * self.k_dim**-0.5
            k = k.repeat_interleave(rep, dim=1)
            rule = delta_rule_recurrent if n == 1 else delta_rule_chunked
            o, new = rule(q, k, v.float(), g, beta.float(), state)
        return o.to(v.dtype), new

    def rule_fresh(self, qkv, g: torch.Tensor, beta: torch.Tensor, batch: int, initial=None, normed=False):
        """``rule`` for ``batch`` sequences of equal length in consecutive rows of qkv (or of its planar
        parts), each from a zero state (``initial`` None) or from its own of ``initial`` [batch, Hv, Dk, Dv]
        fp32 -> (output [rows, Hv, Dv], new states [batch, Hv, Dk, Dv]): one fla call on the GPU. ``normed``: q's
        and k's heads are L2-normalised already (``conv_norm``)."""
        q, k, v = self.split_qkv(qkv)
        n = q.shape[0] // batch
        if not (v.is_cuda and _fla_chunk() is not None):
            zero = v.new_zeros(self.num_v_heads, self.k_dim, self.v_dim, dtype=torch.float32)
            outs = [self.rule(tuple(p[i * n : (i + 1) * n] for p in (q, k, v)), g[i * n : (i + 1) * n],
                              beta[i * n : (i + 1) * n], zero if initial is None else initial[i], normed)
                    for i in range(batch)]  # fmt: skip
            return torch.cat([o for o, _ in outs]), torch.stack([s for _, s in outs])
        o, final = _fla_chunk()(
            q.reshape(batch, n, self.num_k_heads, self.k_dim), k.reshape(batch, n, self.num_k_heads, self.k_dim),
            v.reshape(batch, n, self.num_v_heads, self.v_dim), g.view(batch, n, -1), beta.view(batch, n, -1),
            scale=self.k_dim**-0.5, initial_state=None if initial is None else initial.contiguous(),
            output_final_state=True, use_qk_l2norm_in_kernel=not normed,
        )  # fmt: skip
        return o.reshape(batch * n, self.num_v_heads, self.v_dim).to(v.dtype), final

    def _prefill_varlen(self, mixed, g, beta, ctx) -> torch.Tensor:
        """Every sequence of a GPU step at once: one conv launch, one fla call over the flat rows with
        their offsets (cu_seqlens), the states gathered and stored by device indexing. Per sequence, as
        ``_per_sequence`` computes it (fla chunks each sequence on its own)."""
        from fp4moe.kernels.causal_conv import causal_conv_silu_varlen

        t = ctx.tensors(mixed.device)
        conv_state, rec_state = ctx.deltanet.gather(self.layer_id, ctx)
        norm = self.conv_norm(mixed)
        (q, k, v), new_conv = causal_conv_silu_varlen(
            mixed, conv_state, self.conv1d_weight, t.token_seq, t.starts, t.ends, self.parts(), norm
        )
        n = mixed.shape[0]
        o, new_rec = _fla_chunk()(
            q.reshape(1, n, self.num_k_heads, self.k_dim),
            k.reshape(1, n, self.num_k_heads, self.k_dim),
            v.reshape(1, n, self.num_v_heads, self.v_dim),
            g[None],
            beta[None],
            scale=self.k_dim**-0.5,
            initial_state=rec_state.contiguous(),
            output_final_state=True,
            use_qk_l2norm_in_kernel=not norm,
            cu_seqlens=t.cu_seqlens,
            cu_seqlens_cpu=t.cu_seqlens_cpu,
            chunk_indices=ctx.chunk_indices(mixed.device, 64),
        )  # fmt: skip  (fla's chunks are 64 tokens)
        ctx.deltanet.scatter(self.layer_id, ctx, new_conv, new_rec)
        return o[0].to(mixed.dtype)

    def _per_sequence(self, mixed, g, beta, ctx) -> torch.Tensor:
        """One sequence at a time (the CPU path, the GPU's decode rows and fp32 runs)."""
        outs = []
        for seq, (start, end) in enumerate(ctx.spans()):
            slot = ctx.slots[seq]
            conv_state, rec_state = ctx.deltanet.get(self.layer_id, slot, ctx.cached_lens[seq])
            norm = self.conv_norm(mixed[start:end])
            qkv, new_conv = self._conv(mixed[start:end], conv_state, norm)
            out, new_rec = self.rule(qkv, g[start:end], beta[start:end], rec_state, normed=bool(norm))
            outs.append(out)
            ctx.deltanet.set(self.layer_id, slot, new_conv, new_rec, ctx.cached_lens[seq] + (end - start))
        if len(outs) == 1:  # one sequence: its output is the step's (no copy)
            return outs[0]
        return torch.cat(outs) if outs else mixed.new_empty(0, self.num_v_heads, self.v_dim)

    def conv_norm(self, x: torch.Tensor) -> int:
        """The key head dim where the conv kernel runs over x [n, C] (bf16 GPU prefill) and fla the rule after
        it, which then takes q and k L2-normalised by the kernel (``causal_conv``'s ``norm``); else 0."""
        if not (_conv_kernel_runs(x) and _fla_chunk() is not None):
            return 0  # (before the import: the CPU engine runs without Triton)
        from fp4moe.kernels.causal_conv import norm_fits

        return self.k_dim if norm_fits(self.parts(), self.k_dim) else 0

    def _conv(self, x: torch.Tensor, state: torch.Tensor, norm: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal depthwise conv + SiLU over x [n, C] continuing from state [C, K-1] (the last inputs) ->
        (output, new state); the output is planar (q, k, v) where the GPU kernel makes it, else [n, C];
        ``norm`` (``conv_norm``): the kernel L2-normalises q's and k's heads."""
        if _conv_kernel_runs(x):  # prefill: one kernel, no cat/transposes
            from fp4moe.kernels.causal_conv import causal_conv_silu

            return causal_conv_silu(x, state, self.conv1d_weight, self.parts(), norm)
        full = torch.cat([state.to(x.dtype), x.transpose(0, 1)], dim=-1)  # [C, K-1+n]
        out = F.conv1d(full.unsqueeze(0), self.conv1d_weight, groups=self.conv_dim).squeeze(0)  # [C, n]
        return F.silu(out).transpose(0, 1), full[:, -(self.conv_kernel - 1) :]
