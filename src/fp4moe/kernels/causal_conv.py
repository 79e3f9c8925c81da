"""Gated DeltaNet's causal depthwise conv + SiLU over a prompt chunk (prefill): one program per (token
block, channel block) reads its inputs straight from the projection rows -- the K - 1 positions before the
chunk from the conv state -- so neither the concatenation nor the transposes of the torch path are made
(H200, an 8K prompt: 40 ms of the torch path's cat + depthwise conv per 30 layers). The conv output is
rounded to bf16 before the SiLU and the SiLU's result again, where the torch path rounds.
Reference: ``layers.deltanet.GatedDeltaNet._conv``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4moe.kernels import next_pow2, pdl_args
from fp4moe.kernels.tl_helpers import round_bf16, wait_for_previous


@triton.jit
def _causal_conv_kernel(
    x_ptr, stride_x, state_ptr, w_ptr, out_ptr, stride_o, T, C,
    KC: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous(PDL)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    t_ok = t < T
    c_ok = c < C
    acc = tl.zeros((BT, BC), dtype=tl.float32)
    for i in tl.static_range(KC):  # tap i reads the input KC - 1 - i positions back
        src = t - (KC - 1) + i
        x = tl.load(
            x_ptr + src[:, None].to(tl.int64) * stride_x + c[None, :],
            mask=(src >= 0)[:, None] & t_ok[:, None] & c_ok[None, :],
            other=0.0,
        )
        s = tl.load(  # state [C, KC-1]: the inputs at positions -(KC-1) .. -1
            state_ptr + c[None, :] * (KC - 1) + (KC - 1 + src)[:, None],
            mask=(src < 0)[:, None] & t_ok[:, None] & c_ok[None, :],
            other=0.0,
        )
        w = tl.load(w_ptr + c * KC + i, mask=c_ok, other=0.0).to(tl.float32)
        acc += (x.to(tl.float32) + s.to(tl.float32)) * w[None, :]
    y = round_bf16(acc)
    y = round_bf16(y * tl.sigmoid(y))
    tl.store(
        out_ptr + t[:, None].to(tl.int64) * stride_o + c[None, :],
        y.to(out_ptr.dtype.element_ty),
        mask=t_ok[:, None] & c_ok[None, :],
    )


def causal_conv_silu(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, C] (rows may be strided), state [C, K-1] (the inputs before x), weight [C, K] -> (silu(conv)
    [n, C] in x's dtype, the new state [C, K-1]: the last K-1 inputs)."""
    n, c = x.shape
    kc = weight.shape[-1]
    state = state.to(x.dtype).contiguous()
    out = torch.empty(n, c, dtype=x.dtype, device=x.device)
    bt, bc = min(32, next_pow2(n)), 128
    _causal_conv_kernel[(triton.cdiv(n, bt), triton.cdiv(c, bc))](
        x, x.stride(0), state, weight.reshape(c, kc), out, out.stride(0), n, c,
        KC=kc, BT=bt, BC=bc, num_warps=4, **pdl_args(),
    )  # fmt: skip
    if n >= kc - 1:
        new_state = x[n - (kc - 1) :].transpose(0, 1).contiguous()
    else:
        new_state = torch.cat([state, x.transpose(0, 1)], dim=-1)[:, -(kc - 1) :].contiguous()
    return out, new_state
