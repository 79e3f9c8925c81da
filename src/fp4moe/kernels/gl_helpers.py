"""Small Gluon device functions the Gluon kernels share (``nvfp4_mma_gemv``, ``nvfp4_wgmma``): the Gluon
spellings of ``tl_helpers``' PDL wait and bf16 rounding."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def pdl_wait(PDL: gl.constexpr):
    """``tl_helpers.wait_for_previous`` in Gluon."""
    if PDL == 2:
        gl.inline_asm_elementwise(
            "griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
        )
    if PDL:
        gl.inline_asm_elementwise(
            "griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
        )
    if PDL == 3:
        gl.inline_asm_elementwise(
            "griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
        )


@gluon.jit
def round_bf16(x):
    """fp32 rounded to the nearest bf16, kept in fp32 (``tl_helpers.round_bf16``)."""
    return x.to(gl.bfloat16).to(gl.float32)
