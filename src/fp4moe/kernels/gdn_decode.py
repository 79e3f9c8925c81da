"""Gated DeltaNet decode step, one token per sequence, fused: causal conv update + SiLU, q/k L2 norm,
decay and beta, the delta-rule update of the fp32 recurrent state, the readout, and the gated RMSNorm.
One program per (sequence, value head) holds that head's [Dk, Dv] state in registers.

Conv inputs live in a ring of ``KC`` entries per slot, indexed by position mod KC: the step at position p
reads p-1..p-KC+1 and writes p, a slot no reader of this step touches (programs of the two value heads
that share a key head write the same q/k inputs). Positions below 0 read as zero, and position 0 starts
from a zero state, so a reused slot needs no clearing. Reference: ``layers.deltanet`` (``_conv`` and
``delta_rule_recurrent``), which this kernel matches up to fp32 rounding; the bf16 roundings of the CPU
path are kept at the same places."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4moe.kernels.tl_helpers import round_bf16


@triton.jit
def _conv_channel(proj_row, ring_base, stride_rk, conv_w_ptr, ch, pos, KC: tl.constexpr, WRITE):
    x_new = tl.load(proj_row + ch).to(tl.float32)
    acc = x_new * tl.load(conv_w_ptr + ch * KC + (KC - 1)).to(tl.float32)
    for i in tl.static_range(1, KC):
        prev = tl.load(
            ring_base + ((pos - i + KC) % KC) * stride_rk + ch, mask=(pos - i >= 0) & (ch >= 0), other=0.0
        )
        acc += prev.to(tl.float32) * tl.load(conv_w_ptr + ch * KC + (KC - 1 - i)).to(tl.float32)
    tl.store(
        ring_base + (pos % KC) * stride_rk + ch, x_new.to(ring_base.dtype.element_ty), mask=(ch >= 0) & WRITE
    )
    c = round_bf16(acc)
    return round_bf16(c * tl.sigmoid(c))


@triton.jit
def _gdn_decode_kernel(
    proj_ptr, stride_p, conv_w_ptr, ring_ptr, stride_rs, stride_rk, state_ptr, stride_ss,
    slot_ptr, pos_ptr, a_log_ptr, dt_bias_ptr, norm_w_ptr, out_ptr, stride_o,
    z_off, b_off, a_off, eps,
    HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, KC: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    kh = h // (HV // HK)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    pos = tl.load(pos_ptr + b)
    row = proj_ptr + b.to(tl.int64) * stride_p
    ring = ring_ptr + slot * stride_rs
    dk = tl.arange(0, DK)
    dv = vb * BV + tl.arange(0, BV)
    first = (h % (HV // HK) == 0) & (vb == 0)  # one writer for the shared q/k inputs
    q = _conv_channel(row, ring, stride_rk, conv_w_ptr, kh * DK + dk, pos, KC, first)
    k = _conv_channel(row, ring, stride_rk, conv_w_ptr, HK * DK + kh * DK + dk, pos, KC, first)
    v = _conv_channel(row, ring, stride_rk, conv_w_ptr, 2 * HK * DK + h * DV + dv, pos, KC, True)
    q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6) * (1.0 / tl.sqrt(DK * 1.0))
    k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
    beta = round_bf16(tl.sigmoid(tl.load(row + b_off + h).to(tl.float32)))
    a = tl.load(row + a_off + h).to(tl.float32) + tl.load(dt_bias_ptr + h).to(tl.float32)
    softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))
    g = -tl.exp(tl.load(a_log_ptr + h).to(tl.float32)) * softplus
    s_ptrs = state_ptr + slot * stride_ss + h * DK * DV + dk[:, None] * DV + dv[None, :]
    state = tl.load(s_ptrs, mask=(pos > 0) & (dk[:, None] >= 0), other=0.0)
    state = state * tl.exp(g)
    predicted = tl.sum(state * k[:, None], 0)
    u = (v - predicted) * beta
    state = state + k[:, None] * u[None, :]
    tl.store(s_ptrs, state)
    o = round_bf16(tl.sum(state * q[:, None], 0))
    if BV < DV:  # the gated norm needs the whole head: a second kernel applies it
        tl.store(out_ptr + b.to(tl.int64) * stride_o + h * DV + dv, o.to(out_ptr.dtype.element_ty))
        return
    normed = round_bf16(o * tl.rsqrt(tl.sum(o * o, 0) / DV + eps))
    w = tl.load(norm_w_ptr + dv).to(tl.float32)
    z = tl.load(row + z_off + h * DV + dv).to(tl.float32)
    y = round_bf16(w * normed) * (z * tl.sigmoid(z))
    tl.store(out_ptr + b.to(tl.int64) * stride_o + h * DV + dv, round_bf16(y).to(out_ptr.dtype.element_ty))


@triton.jit
def _gated_norm_kernel(
    o_ptr, proj_ptr, stride_p, z_off, norm_w_ptr, out_ptr, eps, HV: tl.constexpr, DV: tl.constexpr
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    dv = tl.arange(0, DV)
    o = tl.load(o_ptr + (b.to(tl.int64) * HV + h) * DV + dv).to(tl.float32)
    normed = round_bf16(o * tl.rsqrt(tl.sum(o * o, 0) / DV + eps))
    w = tl.load(norm_w_ptr + dv).to(tl.float32)
    z = tl.load(proj_ptr + b.to(tl.int64) * stride_p + z_off + h * DV + dv).to(tl.float32)
    y = round_bf16(w * normed) * (z * tl.sigmoid(z))
    tl.store(out_ptr + (b.to(tl.int64) * HV + h) * DV + dv, round_bf16(y).to(out_ptr.dtype.element_ty))


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
):
    """proj [B, conv_dim + Hv*Dv + 2*Hv] (fused in_proj output: qkv | z | b | a), conv_w [C, KC],
    ring [slots, KC, C], state [slots, Hv, Dk, Dv] fp32, slots/positions [B] int32 -> [B, Hv*Dv].
    ``dims`` = (Hk, Hv, Dk, Dv)."""
    hk, hv, dk, dv = dims
    b = proj.shape[0]
    conv_dim = 2 * hk * dk + hv * dv
    if out is None:
        out = torch.empty(b, hv * dv, dtype=proj.dtype, device=proj.device)
    if v_splits is None:  # enough programs to fill the GPU at small batch (H200 sweep: tune_kernels.py)
        v_splits = max(1, min(8, 256 // (b * hv), dv // 16))
        v_splits = 1 << (v_splits.bit_length() - 1)  # a power of two, so it divides Dv (a power of two)
    if num_warps is None:
        num_warps = 8 if v_splits >= 8 else 4
    raw = out if v_splits == 1 else torch.empty_like(out)
    z_off = conv_dim
    _gdn_decode_kernel[(b, hv, v_splits)](
        proj, proj.stride(0), conv_w, ring, ring.stride(0), ring.stride(1), state, state.stride(0),
        slots, positions, a_log, dt_bias, norm_w, raw, raw.stride(0),
        z_off, conv_dim + hv * dv, conv_dim + hv * dv + hv, eps,
        HK=hk, HV=hv, DK=dk, DV=dv, KC=conv_w.shape[-1], BV=dv // v_splits, num_warps=num_warps,
    )  # fmt: skip
    if v_splits > 1:
        _gated_norm_kernel[(b, hv)](raw, proj, proj.stride(0), z_off, norm_w, out, eps, HV=hv, DV=dv)
    return out
