"""Gated DeltaNet decode step, fused: causal conv update + SiLU, q/k L2 norm, decay and beta, the delta-rule
update of the fp32 recurrent state, the readout, and the gated RMSNorm. One program per (sequence, value
head, value block) holds that part of the head's [Dk, Dv] state in registers and walks the sequence's
``T`` tokens in order: T = 1 for plain decoding, T = k + 1 to verify k speculative drafts.

Conv inputs live in a ring of ``RING`` >= KC - 1 + T entries per slot, indexed by position mod RING: the
token at position p+t reads p+t-1..p+t-KC+1 -- from the projection rows of this step where they are among
its own T tokens, from the ring otherwise -- and writes p+t, an entry no reader of this step touches
(programs of the value heads that share a key head write the same q/k inputs). Because the ring holds
KC - 1 + T positions, inputs of rejected drafts never overwrite ones a rolled-back sequence still needs.
Positions below 0 read as zero, and position 0 starts from a zero state, so a reused slot needs no
clearing. The state after the last token goes back into the slot; with T > 1 the states after the tokens
before it go into ``history[b, t]``, and the round's rollback (``restore_states``) copies the one after the
last accepted token into the slot where not all were accepted -- when every draft is, nothing moves.

Reference: ``layers.deltanet`` (``_conv`` and ``delta_rule_recurrent``), which this kernel matches up to
fp32 rounding; the bf16 roundings of the CPU path are kept at the same places."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4moe.kernels import INTERPRET, pdl_args
from fp4moe.kernels.tl_helpers import round_bf16, wait_for_previous


@triton.jit
def _conv_channel(
    rows, stride_p, ring_base, stride_rk, conv_w_ptr, ch, pos, t: tl.constexpr, KC: tl.constexpr,
    RING: tl.constexpr, WRITE,
):  # fmt: skip
    """Conv output (after SiLU) of channels ``ch`` for the token at position pos + t; ``rows`` points at
    the sequence's first projection row of this step."""
    x_new = tl.load(rows + t * stride_p + ch).to(tl.float32)
    acc = x_new * tl.load(conv_w_ptr + ch * KC + (KC - 1)).to(tl.float32)
    for i in tl.static_range(1, KC):
        if i <= t:  # an input of this step
            prev = tl.load(rows + (t - i) * stride_p + ch)
        else:
            p = pos + t - i
            prev = tl.load(
                ring_base + ((p + RING) % RING) * stride_rk + ch, mask=(p >= 0) & (ch >= 0), other=0.0
            )
        acc += prev.to(tl.float32) * tl.load(conv_w_ptr + ch * KC + (KC - 1 - i)).to(tl.float32)
    tl.store(
        ring_base + ((pos + t) % RING) * stride_rk + ch,
        x_new.to(ring_base.dtype.element_ty),
        mask=(ch >= 0) & WRITE,
    )
    c = round_bf16(acc)
    return round_bf16(c * tl.sigmoid(c))


@triton.jit
def _gdn_decode_kernel(
    proj_ptr, stride_p, conv_w_ptr, ring_ptr, stride_rs, stride_rk, state_ptr, stride_ss, hist_ptr, stride_hb,
    slot_ptr, pos_ptr, a_log_ptr, dt_bias_ptr, norm_w_ptr, out_ptr, stride_o,
    z_off, b_off, a_off, eps,
    HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, KC: tl.constexpr, BV: tl.constexpr,
    T: tl.constexpr, RING: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    kh = h // (HV // HK)
    first_row = b.to(tl.int64) * T
    # before the wait: the recurrent state, slots and positions are not written by the kernels just ahead
    # (the projection GEMV lets this kernel start early), so their loads overlap them
    slot = tl.load(slot_ptr + first_row).to(tl.int64)
    pos = tl.load(pos_ptr + first_row)
    dk = tl.arange(0, DK)
    dv = vb * BV + tl.arange(0, BV)
    s_ptrs = state_ptr + slot * stride_ss + h * DK * DV + dk[:, None] * DV + dv[None, :]
    state = tl.load(s_ptrs, mask=(pos > 0) & (dk[:, None] >= 0), other=0.0)
    a_log = tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    wait_for_previous(PDL)
    rows = proj_ptr + first_row * stride_p
    ring = ring_ptr + slot * stride_rs
    first = (h % (HV // HK) == 0) & (vb == 0)  # one writer for the shared q/k inputs
    for t in tl.static_range(T):
        row = rows + t * stride_p
        q = _conv_channel(rows, stride_p, ring, stride_rk, conv_w_ptr, kh * DK + dk, pos, t, KC, RING, first)
        k = _conv_channel(
            rows, stride_p, ring, stride_rk, conv_w_ptr, HK * DK + kh * DK + dk, pos, t, KC, RING, first
        )
        v = _conv_channel(
            rows, stride_p, ring, stride_rk, conv_w_ptr, 2 * HK * DK + h * DV + dv, pos, t, KC, RING, True
        )
        q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6) * (1.0 / tl.sqrt(DK * 1.0))
        k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
        beta = round_bf16(tl.sigmoid(tl.load(row + b_off + h).to(tl.float32)))
        a = tl.load(row + a_off + h).to(tl.float32) + dt_bias
        softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))
        state = state * tl.exp(-a_log * softplus)
        predicted = tl.sum(state * k[:, None], 0)
        u = (v - predicted) * beta
        state = state + k[:, None] * u[None, :]
        if t < T - 1:  # the state after each token but the last, for rollback to the last accepted one
            h_ptrs = hist_ptr + (first_row + t) * stride_hb + h * DK * DV + dk[:, None] * DV + dv[None, :]
            tl.store(h_ptrs, state)
        o = round_bf16(tl.sum(state * q[:, None], 0))
        out_row = out_ptr + (first_row + t) * stride_o
        if BV < DV:  # the gated norm needs the whole head: a second kernel applies it
            tl.store(out_row + h * DV + dv, o.to(out_ptr.dtype.element_ty))
        else:
            normed = round_bf16(o * tl.rsqrt(tl.sum(o * o, 0) / DV + eps))
            w = tl.load(norm_w_ptr + dv).to(tl.float32)
            z = tl.load(row + z_off + h * DV + dv).to(tl.float32)
            y = round_bf16(w * normed) * (z * tl.sigmoid(z))
            tl.store(out_row + h * DV + dv, round_bf16(y).to(out_ptr.dtype.element_ty))
    tl.store(s_ptrs, state)


@triton.jit
def _restore_states_kernel(
    hist_ptr, stride_hl, stride_hr, state_ptr, stride_sl, stride_ss, accepted_ptr, stride_a, slot_ptr, n,
    T: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Program (layer, sequence, block): the sequence's state after its last accepted token, from the
    history into its slot -- unless it accepted every draft (the slot holds that state already)."""
    layer = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    a = tl.load(accepted_ptr + b * stride_a)
    if a < T - 1:
        slot = tl.load(slot_ptr + b).to(tl.int64)
        offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(hist_ptr + layer * stride_hl + (b * T + a).to(tl.int64) * stride_hr + offs, mask=mask)
        tl.store(state_ptr + layer * stride_sl + slot * stride_ss + offs, x, mask=mask)


def restore_states(history, state, accepted, slots, tokens_per_seq: int, kernel: bool | None = None) -> None:
    """A speculative round's rollback of the Gated DeltaNet states, in place: history [L, >= B*T, ...] (the
    states after each verified token but the last, ``gdn_decode`` with T = ``tokens_per_seq``), state [L,
    slots, ...] (after the last), accepted [B] drafts per sequence, slots [B] -> sequence b's state
    becomes history[:, b*T + a_b] where a_b < T - 1. ``kernel`` (default: on CUDA tensors): the Triton
    kernel, one pass that a CUDA graph can hold; else torch (``restore_states_reference``)."""
    b, t = accepted.shape[0], tokens_per_seq
    if (
        history.shape[1] < b * t
        or state.shape[0] != history.shape[0]
        or state.shape[2:] != history.shape[2:]
        or not (history[0, 0].is_contiguous() and state[0, 0].is_contiguous())
    ):
        raise ValueError(f"history {tuple(history.shape)} and state {tuple(state.shape)} for {b} x {t} rows")
    if not (history.is_cuda if kernel is None else kernel):
        restore_states_reference(history, state, accepted, slots, t)
        return
    n = history[0, 0].numel()
    block = min(4096, triton.next_power_of_2(n))
    if b:
        _restore_states_kernel[(history.shape[0], b, triton.cdiv(n, block))](
            history, history.stride(0), history.stride(1), state, state.stride(0), state.stride(1),
            accepted, accepted.stride(0), slots, n, T=t, BLOCK=block, num_warps=4,
        )  # fmt: skip


def restore_states_reference(history, state, accepted, slots, tokens_per_seq: int) -> None:
    """``restore_states`` in torch (data-dependent shapes: not for a CUDA graph)."""
    rows = torch.arange(accepted.shape[0], device=accepted.device) * tokens_per_seq + accepted
    moved = accepted < tokens_per_seq - 1
    state.index_copy_(1, slots[moved].long(), history[:, rows[moved]])


@triton.jit
def _gated_norm_kernel(
    o_ptr,
    z_ptr,
    stride_z,
    norm_w_ptr,
    out_ptr,
    eps,
    HV: tl.constexpr,
    DV: tl.constexpr,
    HB: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (row b, head block): HB heads of one row as an [HB, DV] tile, each normed on its own."""
    wait_for_previous(PDL)
    b = tl.program_id(0).to(tl.int64)
    hh = tl.program_id(1) * HB + tl.arange(0, HB)
    dv = tl.arange(0, DV)
    cols = hh[:, None] * DV + dv[None, :]
    o = tl.load(o_ptr + b * HV * DV + cols).to(tl.float32)
    normed = round_bf16(o * tl.rsqrt(tl.sum(o * o, 1) / DV + eps)[:, None])
    w = tl.load(norm_w_ptr + dv).to(tl.float32)
    z = tl.load(z_ptr + b * stride_z + cols).to(tl.float32)
    y = round_bf16(w[None, :] * normed) * (z * tl.sigmoid(z))
    tl.store(out_ptr + b * HV * DV + cols, round_bf16(y).to(out_ptr.dtype.element_ty))


def gdn_decode(
    proj,
    conv_w,
    ring,
    state,
    slots,
    positions,
    a_log,
    dt_bias,
    norm_w,
    eps,
    dims,
    out=None,
    v_splits=None,
    num_warps=None,
    tokens_per_seq: int = 1,
    history=None,
):
    """proj [B*T, conv_dim + Hv*Dv + 2*Hv] (fused in_proj output: qkv | z | b | a; a sequence's T rows
    consecutive), conv_w [C, KC], ring [slots, RING, C], state [slots, Hv, Dk, Dv] fp32, slots/positions
    [B*T] int32 (per row; a sequence's rows at consecutive positions) -> [B*T, Hv*Dv]. ``dims`` = (Hk, Hv,
    Dk, Dv). The slot's state becomes the one after the sequence's last row; with ``tokens_per_seq`` T > 1
    ``history`` [>= B*T, Hv, Dk, Dv] fp32 receives the state after each of the rows before it (row b*T + t,
    t < T - 1) for ``restore_states``."""
    hk, hv, dk, dv = dims
    t = tokens_per_seq
    rows = proj.shape[0]
    b = rows // t
    kc, ring_len = conv_w.shape[-1], ring.shape[1]
    if rows % t or ring_len < kc - 1 + t or (t > 1 and history is None):
        raise ValueError(f"{rows} rows, {t} tokens per sequence, a ring of {ring_len} for a conv of {kc}")
    conv_dim = 2 * hk * dk + hv * dv
    if out is None:
        out = torch.empty(rows, hv * dv, dtype=proj.dtype, device=proj.device)
    if v_splits is None:  # more programs at small batch; H200, in the captured decode step
        # (benchmarks/tune/tune_decode.py): 4 splits at batch 1 1.4% faster than 8. Under Triton's interpreter (CI)
        # one: each split recomputes the q/k conv (tests/kernels checks 2 and 4 splits)
        v_splits = 1 if INTERPRET else max(1, min(4, 256 // (b * hv), dv // 16))
        v_splits = 1 << (v_splits.bit_length() - 1)  # a power of two, so it divides Dv (a power of two)
    if num_warps is None:
        num_warps = 8 if v_splits >= 8 else 4
    raw = out if v_splits == 1 else torch.empty_like(out)
    hist = state if history is None else history
    z_off = conv_dim
    _gdn_decode_kernel[(b, hv, v_splits)](
        proj, proj.stride(0), conv_w, ring, ring.stride(0), ring.stride(1), state, state.stride(0),
        hist, hist.stride(0), slots, positions, a_log, dt_bias, norm_w, raw, raw.stride(0),
        z_off, conv_dim + hv * dv, conv_dim + hv * dv + hv, eps,
        HK=hk, HV=hv, DK=dk, DV=dv, KC=kc, BV=dv // v_splits, T=t, RING=ring_len, num_warps=num_warps, **pdl_args(),
    )  # fmt: skip
    if v_splits > 1:  # the gated norm needs whole heads: a second launch
        gated_norm(raw, proj[:, z_off : z_off + hv * dv], norm_w, eps, hv, out)
    return out


def gated_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, heads: int, out=None):
    """The gated RMSNorm alone (after the chunked rule in prefill, or after a decode step whose value heads
    were split across programs): o [T, Hv*Dv] contiguous, z [T, Hv*Dv] (rows may be strided) ->
    w * rmsnorm(o) * silu(z) per head [T, Hv*Dv] (into ``out`` if given). Reference:
    ``layers.norm.gated_rms_norm``."""
    rows, width = o.shape
    out = torch.empty_like(o) if out is None else out
    # a prefill's rows take every head in one program (one program per (row, head) and 4 warps on 128
    # values: 5.5 ms of an 8K prefill on the H200); a few decode rows keep a program per head
    hb = heads if rows >= 64 and heads & (heads - 1) == 0 else 1
    while hb > 1 and hb * (width // heads) > 4096:  # at most 4096 values a program (32 per thread)
        hb //= 2
    _gated_norm_kernel[(rows, heads // hb)](
        o, z, z.stride(0), weight, out, eps, HV=heads, DV=width // heads, HB=hb,
        num_warps=4, **pdl_args("start"),  # out_proj's GEMV loads its first weight tile meanwhile
    )  # fmt: skip
    return out
