"""Gated DeltaNet's causal depthwise conv + SiLU over a prompt chunk (prefill): one program per (token
block, channel block) reads its inputs straight from the projection rows -- the K - 1 positions before the
chunk from the conv state -- so neither the concatenation nor the transposes of the torch path are made
(H200, an 8K prompt: 40 ms of the torch path's cat + depthwise conv per 30 layers). The conv output is
rounded to bf16 before the SiLU and the SiLU's result again, where the torch path rounds.

With ``parts`` the output is planar: the channels before ``parts[0]`` (q), from there to ``parts[1]`` (k) and
the rest (v) each fill a contiguous [n, width] block of one buffer, so fla's chunked rule takes q, k and v
as they are -- it copied every strided view of a [n, C] output first (an 8K prompt on the H200: 4.9 ms of
copies over 30 layers, ``benchmarks/prefill_profile.py``). Same values, another layout.

With ``norm`` (the key head dim) q's and k's heads come out L2-normalised as fla's ``l2norm_fwd`` normalises
them (x / sqrt(sum x^2 + 1e-6) in fp32 from the bf16 SiLU output, rounded to bf16), so fla is called without
its own pass over q and k (``use_qk_l2norm_in_kernel=False``: two more launches reading and writing both, ~1 ms
of an 8K prefill on the H200).
Reference: ``layers.deltanet.GatedDeltaNet._conv``; fla's ``l2norm_fwd`` for the normalisation."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from fp4moe.kernels import pdl_args
from fp4moe.kernels.tl_helpers import round_bf16, wait_for_previous

# (token rows, channels, warps) of a program: one tile shape for every token count -- per-count variants were
# compiled on users' requests (py-spy on the H200 server at 16 streams: 30% of the engine thread in Triton's
# compiler, all for this kernel); benchmarks/tune/tune_conv.py times others
TILE = (32, 128, 4)
L2_EPS = 1e-6  # fla's l2norm_fwd default, which chunk_gated_delta_rule uses
# FP4MOE_CONV_KERNEL=window: ``_conv_window_kernel`` (a 4-tap conv, each input row read and converted once into a
# sliding window; sm90 SASS 31.6 instructions an output element against the taps kernel's 44, 128 registers
# against 184-252). Off by default until timed on the H200 (benchmarks/tune/tune_conv.py times both); (rows,
# channels, warps) of its programs
WINDOW = os.environ.get("FP4MOE_CONV_KERNEL", "taps") == "window"
WINDOW_TILE = (16, 1024, 4)


@triton.jit(do_not_specialize=["T"])  # the token count: a server meets every value (issue 20)
def _causal_conv_kernel(
    x_ptr, stride_x, state_ptr, w_ptr, out_ptr, seq_ptr, start_ptr, T, C, P1, P2, eps,
    KC: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, VARLEN: tl.constexpr, PDL: tl.constexpr,
    KD: tl.constexpr = 0,
):  # fmt: skip
    wait_for_previous(PDL)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    t_ok = t < T
    c_ok = c < C
    if VARLEN:  # rows of several sequences: each reads its own sequence's rows and state
        s = tl.load(seq_ptr + t, mask=t_ok, other=0)
        first = tl.load(start_ptr + s, mask=t_ok, other=0)
    else:
        s = tl.zeros((BT,), dtype=tl.int32)
        first = tl.zeros((BT,), dtype=tl.int32)
    acc = tl.zeros((BT, BC), dtype=tl.float32)
    # every row of the block reads only rows of x (no position before its sequence's first row): one load
    # per tap, with no state addresses (most blocks of a long prompt)
    inside_x = tl.min(tl.where(t_ok, t - (KC - 1) - first, 0)) >= 0
    if inside_x:
        for i in tl.static_range(KC):
            x = tl.load(
                x_ptr + (t - (KC - 1) + i)[:, None].to(tl.int64) * stride_x + c[None, :],
                mask=t_ok[:, None] & c_ok[None, :],
                other=0.0,
            )
            w = tl.load(w_ptr + c * KC + i, mask=c_ok, other=0.0).to(tl.float32)
            acc += x.to(tl.float32) * w[None, :]
    else:
        for i in tl.static_range(KC):  # tap i reads the input KC - 1 - i positions back
            src = t - (KC - 1) + i
            inside = src >= first
            x = tl.load(
                x_ptr + src[:, None].to(tl.int64) * stride_x + c[None, :],
                mask=inside[:, None] & t_ok[:, None] & c_ok[None, :],
                other=0.0,
            )
            st = tl.load(  # state [N, C, KC-1]: the sequence's inputs at positions -(KC-1) .. -1
                state_ptr
                + s[:, None].to(tl.int64) * C * (KC - 1)
                + c[None, :] * (KC - 1)
                + (KC - 1 + src - first)[:, None],
                mask=(~inside)[:, None] & t_ok[:, None] & c_ok[None, :],
                other=0.0,
            )
            w = tl.load(w_ptr + c * KC + i, mask=c_ok, other=0.0).to(tl.float32)
            acc += (x.to(tl.float32) + st.to(tl.float32)) * w[None, :]
    y = round_bf16(acc)
    y = round_bf16(y * tl.sigmoid(y))
    if KD > 0:  # q's and k's heads (channels before P2) L2-normalised, KD channels each
        if KD == BC:
            normed = y * (1 / tl.sqrt(tl.sum(y * y, 1) + eps))[:, None]
        else:
            heads = tl.reshape(y, (BT, BC // KD, KD))
            rstd = 1 / tl.sqrt(tl.sum(heads * heads, 2) + eps)
            normed = tl.reshape(heads * rstd[:, :, None], (BT, BC))
        y = tl.where((c < P2)[None, :], round_bf16(normed), y)
    # planar output: channel c of part p (columns [lo_p, hi_p)) at T * lo_p + t * (hi_p - lo_p) + c - lo_p;
    # P1 = P2 = C is one part, the row-major [T, C]
    lo = tl.where(c >= P2, P2, tl.where(c >= P1, P1, 0))
    width = tl.where(c >= P2, C - P2, tl.where(c >= P1, P2 - P1, P1))
    tl.store(
        out_ptr + lo[None, :].to(tl.int64) * T + t[:, None].to(tl.int64) * width[None, :] + (c - lo)[None, :],
        y.to(out_ptr.dtype.element_ty),
        mask=t_ok[:, None] & c_ok[None, :],
    )


@triton.jit
def _silu_norm(acc, c, P2, eps, BC: tl.constexpr, KD: tl.constexpr):
    """One row's conv sums [BC] -> bf16-rounded silu (and q's and k's heads L2-normalised), as the taps kernel."""
    y = round_bf16(acc)
    y = round_bf16(y * tl.sigmoid(y))
    if KD > 0:
        if KD == BC:
            normed = y * (1 / tl.sqrt(tl.sum(y * y, 0) + eps))
        else:
            heads = tl.reshape(y, (BC // KD, KD))
            rstd = 1 / tl.sqrt(tl.sum(heads * heads, 1) + eps)
            normed = tl.reshape(heads * rstd[:, None], (BC,))
        y = tl.where(c < P2, round_bf16(normed), y)
    return y


@triton.jit(do_not_specialize=["T"])
def _conv_window_kernel(
    x_ptr, stride_x, state_ptr, w_ptr, out_ptr, seq_ptr, start_ptr, T, C, P1, P2, eps,
    BT: tl.constexpr, BC: tl.constexpr, VARLEN: tl.constexpr, PDL: tl.constexpr, KD: tl.constexpr = 0,
):  # fmt: skip
    """The taps kernel's conv for 4 taps, a program's BT rows in turn: each input row is loaded and converted
    once and kept for the next three rows (the taps kernel loads every row four times), so a program spans BC
    channels (8 a thread: 16-byte loads and stores) and its rows run unrolled. Rows whose taps reach before
    their sequence's first row take those inputs from its conv state. The same fp32 sums in the same order
    (bit for bit the taps kernel's outputs), but for the heads' L2 norm on the GPU: the compiler sums a head's
    squares in another order for each kernel's layout, so a normalised element may differ by a bf16 step."""
    wait_for_previous(PDL)
    t0 = tl.program_id(0) * BT
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    c_ok = c < C
    w0 = tl.load(w_ptr + c * 4, mask=c_ok, other=0.0).to(tl.float32)
    w1 = tl.load(w_ptr + c * 4 + 1, mask=c_ok, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + c * 4 + 2, mask=c_ok, other=0.0).to(tl.float32)
    w3 = tl.load(w_ptr + c * 4 + 3, mask=c_ok, other=0.0).to(tl.float32)
    # planar output: channel c of part p (columns [lo_p, hi_p)) at T * lo_p + t * (hi_p - lo_p) + c - lo_p
    lo = tl.where(c >= P2, P2, tl.where(c >= P1, P1, 0))
    width = tl.where(c >= P2, C - P2, tl.where(c >= P1, P2 - P1, P1))
    out_c = out_ptr + lo.to(tl.int64) * T + (c - lo)
    # every row of the block reads only rows of x (no position before its sequence's first row): no state
    t_last = tl.minimum(t0 + BT, T) - 1
    first_last = tl.load(start_ptr + tl.load(seq_ptr + t_last)) if VARLEN else 0
    if t0 - 3 >= first_last:  # (rows t0 - 3 .. of one sequence: the last row's)
        x1 = tl.load(x_ptr + (t0 - 3).to(tl.int64) * stride_x + c, mask=c_ok, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + (t0 - 2).to(tl.int64) * stride_x + c, mask=c_ok, other=0.0).to(tl.float32)
        x3 = tl.load(x_ptr + (t0 - 1).to(tl.int64) * stride_x + c, mask=c_ok, other=0.0).to(tl.float32)
        for r in tl.static_range(BT):
            t = t0 + r
            ok = t < T
            xt = tl.load(x_ptr + t.to(tl.int64) * stride_x + c, mask=c_ok & ok, other=0.0).to(tl.float32)
            acc = tl.zeros((BC,), dtype=tl.float32)
            acc += x1 * w0
            acc += x2 * w1
            acc += x3 * w2
            acc += xt * w3
            y = _silu_norm(acc, c, P2, eps, BC, KD)
            tl.store(out_c + t.to(tl.int64) * width, y.to(out_ptr.dtype.element_ty), mask=c_ok & ok)
            x1, x2, x3 = x2, x3, xt
    else:  # each tap of each row from x or, before the row's sequence, from its state [N, C, 3]
        for r in tl.static_range(BT):
            t = t0 + r
            ok = t < T
            if VARLEN:
                s = tl.load(seq_ptr + t, mask=ok, other=0)
                first = tl.load(start_ptr + s, mask=ok, other=0)
            else:
                s = t * 0
                first = t * 0
            acc = tl.zeros((BC,), dtype=tl.float32)
            for i in tl.static_range(4):  # tap i reads the input 3 - i positions back
                src = t - 3 + i
                inside = src >= first
                xv = tl.load(x_ptr + src.to(tl.int64) * stride_x + c, mask=c_ok & ok & inside, other=0.0)
                sv = tl.load(
                    state_ptr + s.to(tl.int64) * C * 3 + c * 3 + (3 + src - first),
                    mask=c_ok & ok & (src < first),
                    other=0.0,
                )
                wi = w0 if i == 0 else (w1 if i == 1 else (w2 if i == 2 else w3))
                acc += (xv.to(tl.float32) + sv.to(tl.float32)) * wi
            y = _silu_norm(acc, c, P2, eps, BC, KD)
            tl.store(out_c + t.to(tl.int64) * width, y.to(out_ptr.dtype.element_ty), mask=c_ok & ok)


def causal_conv_silu(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, parts: tuple[int, int] | None = None,
    norm: int = 0,
) -> tuple[torch.Tensor | tuple[torch.Tensor, ...], torch.Tensor]:  # fmt: skip
    """x [n, C] (rows may be strided), state [C, K-1] (the inputs before x), weight [C, K] -> (silu(conv)
    [n, C] in x's dtype -- with ``parts`` (a, b) its contiguous column blocks [n, a], [n, b - a], [n, C - b]
    instead, and with ``norm`` the first two blocks' heads of ``norm`` channels L2-normalised -- and the new
    state [C, K-1]: the last K-1 inputs)."""
    n = x.shape[0]
    out = _launch(x, state.to(x.dtype).contiguous(), weight, None, None, parts, norm)
    kc = weight.shape[-1]
    if n >= kc - 1:
        new_state = x[n - (kc - 1) :].transpose(0, 1).contiguous()
    else:
        new_state = torch.cat([state.to(x.dtype), x.transpose(0, 1)], dim=-1)[:, -(kc - 1) :].contiguous()
    return out, new_state


def causal_conv_silu_varlen(
    x: torch.Tensor, states: torch.Tensor, weight: torch.Tensor, token_seq: torch.Tensor, starts: torch.Tensor,
    ends: torch.Tensor, parts: tuple[int, int] | None = None, norm: int = 0,
) -> tuple[torch.Tensor | tuple[torch.Tensor, ...], torch.Tensor]:  # fmt: skip
    """Several sequences' rows in one launch: x [T, C] (sequence ``token_seq[t]`` owns row t; sequence i
    rows ``starts[i]`` .. ``ends[i]`` - 1), states [N, C, K-1] -> (silu(conv) [T, C] or its ``parts``, new
    states [N, C, K-1]). Each sequence as ``causal_conv_silu`` computes it alone."""
    states = states.to(x.dtype).contiguous()
    out = _launch(x, states, weight, token_seq, starts, parts, norm)
    return out, last_inputs(x, states, starts, ends)


def last_inputs(
    x: torch.Tensor, states: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor
) -> torch.Tensor:
    """Each sequence's last K-1 inputs [N, C, K-1] after its rows of x [T, C]: the rows before its end,
    reaching back into its state [N, C, K-1] where it has fewer rows -- device ops only (no host sync)."""
    kc1 = states.shape[-1]
    pos = ends[:, None] - kc1 + torch.arange(kc1, device=x.device)  # [N, K-1] rows wanted
    from_x = x[pos.clamp(min=0)].transpose(1, 2)  # [N, C, K-1]
    back = (kc1 + pos - starts[:, None].long()).clamp(0, kc1 - 1)  # column of the state where pos < start
    from_state = states.gather(2, back[:, None, :].expand(-1, states.shape[1], -1))
    return torch.where((pos >= starts[:, None])[:, None, :], from_x, from_state).contiguous()


def window_fits(kc: int, norm: int) -> bool:
    """Whether ``_conv_window_kernel`` runs this conv: switched on (``WINDOW``), 4 taps, heads that divide its
    channel block."""
    return WINDOW and kc == 4 and WINDOW_TILE[1] % max(norm, 1) == 0


def norm_fits(parts: tuple[int, int] | None, norm: int) -> bool:
    """Whether the conv kernel can L2-normalise heads of ``norm`` channels before ``parts[1]``: a power of two
    that divides the kernel's channel block (so no head straddles two programs) and both split points."""
    bc = TILE[1]
    return (
        bool(parts)
        and norm > 0
        and norm & (norm - 1) == 0
        and bc % norm == 0
        and parts[0] % norm == 0 == parts[1] % norm
    )


def _launch(x, states, weight, token_seq, starts, parts=None, norm: int = 0):
    n, c = x.shape
    kc = weight.shape[-1]
    p1, p2 = parts or (c, c)
    if not 0 <= p1 <= p2 <= c:
        raise ValueError(f"parts {parts} do not split {c} channels")
    if norm and not norm_fits(parts, norm):
        raise ValueError(
            f"cannot normalise heads of {norm} channels with parts {parts} ({TILE[1]}-channel blocks)"
        )
    flat = torch.empty(n * c, dtype=x.dtype, device=x.device)
    varlen = token_seq is not None
    if window_fits(kc, norm):
        bt, bc, warps = WINDOW_TILE
        _conv_window_kernel[(triton.cdiv(n, bt), triton.cdiv(c, bc))](
            x, x.stride(0), states, weight.reshape(c, kc), flat, token_seq if varlen else x,
            starts if varlen else x, n, c, p1, p2, L2_EPS, BT=bt, BC=bc, VARLEN=varlen, KD=norm,
            num_warps=warps, **pdl_args(),
        )  # fmt: skip
    else:
        bt, bc, warps = TILE
        _causal_conv_kernel[(triton.cdiv(n, bt), triton.cdiv(c, bc))](
            x, x.stride(0), states, weight.reshape(c, kc), flat, token_seq if varlen else x,
            starts if varlen else x, n, c, p1, p2, L2_EPS, KC=kc, BT=bt, BC=bc, VARLEN=varlen, KD=norm,
            num_warps=warps, **pdl_args(),
        )  # fmt: skip
    if parts is None:
        return flat.view(n, c)
    return tuple(flat[n * lo : n * hi].view(n, hi - lo) for lo, hi in ((0, p1), (p1, p2), (p2, c)))
