"""The expert GEMM kernel's GPU-only variants compile for the H200 (sm90) here, without a GPU: Triton's
front end and the ptxas it ships turn them into machine code. The interpreter runs Python, so it accepts
kernels the GPU compiler refuses (a constexpr branch that returns early, inline PTX) -- this catches those
before a device run does. Runs in a subprocess: the test session has Triton's interpreter switched on,
which replaces every jitted function."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

VARIANTS = [
    (7, 1, 0, False),  # decode gate/up (GATED), the default dequantization
    (7, 2, 0, False),  # decode down (WEIGHTED)
    (7, 3, 0, False),  # split gate/up (PARTIAL)
    (4, 2, 2, False),  # down finishing split partial sums
    (7, 0, 0, True),  # dense NVFP4 linear
    (3, 0, 0, True),  # FP8 linear
    (0, 1, 0, False),  # bf16 experts
    (0, 0, 0, True),  # bf16 linear for a few rows
]

SCRIPT = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fp4moe.kernels import moe_routing
from fp4moe.kernels import nvfp4_gemm as gemm

POINTERS = {
    "a_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*u8", "d_ptr": "*fp32", "out_ptr": "*bf16", "order_ptr": "*i32",
    "blk_expert_ptr": "*i32", "blk_start_ptr": "*i32", "blk_count_ptr": "*i32", "nblk_ptr": "*i32",
    "topw_ptr": "*fp32",
}
fn = gemm._w4a16_kernel
results = []
for mode, epilogue, act_splits, dense in json.loads(sys.argv[1]):
    # NVFP4 experts in the GPU engine's tile order at the full-size model's 64-byte steps (expert_layout)
    consts = dict(DENSE=dense, MODE=mode, EPILOGUE=epilogue, ACT_SPLITS=act_splits, BM=16, BN=64, BK=128,
                  EVEN_K=True, DOT_F32=False, PDL=True, TILE=0 if dense or mode in (0, 3) else 64)
    pointers = dict(POINTERS)
    if act_splits:
        pointers["a_ptr"] = "*fp32"
    if epilogue in (gemm.WEIGHTED, gemm.PARTIAL):
        pointers["out_ptr"] = "*fp32"
    if mode == 0:
        pointers["w_ptr"] = pointers["s_ptr"] = "*bf16"
    signature = {n: "constexpr" if n in consts else pointers.get(n, "i32") for n in fn.arg_names}
    # as the launcher specializes them: pointers, strides and sizes of the full-size model are multiples of 16
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n not in consts and n not in ("TOPK", "stride_de")}
    src = ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs)
    try:
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=3))
        results.append(dict(ok=bool(k.asm["cubin"]), prmt="prmt.b32" in k.asm["ptx"], error=""))
    except Exception as exc:
        results.append(dict(ok=False, prmt=False, error=f"{type(exc).__name__}: {exc}"[-2000:]))
for tkp in (8, 512, 4096):  # the align kernel's bitonic sort and histogram, small and large
    fn = moe_routing._align_kernel
    consts = dict(E=256, BM=16, TKP=tkp, PDL=True)
    signature = {n: "constexpr" if n in consts else ("i32" if n == "TK" else "*i32") for n in fn.arg_names}
    try:
        k = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts),
                           target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8))
        results.append(dict(ok=bool(k.asm["cubin"]), prmt=False, error=""))
    except Exception as exc:
        results.append(dict(ok=False, prmt=False, error=f"{type(exc).__name__}: {exc}"[-2000:]))
from fp4moe.kernels import nvfp4_gemv as gemv
fn = gemv._gemv_kernel
for mode, gated, sum_each, dense in ((7, True, False, False), (7, False, True, False), (4, True, True, False),
                                     (0, True, False, False), (0, False, True, True)):  # the decode GEMVs
    # as the engine launches them: PDL 3 (gate/up: trigger after the wait), 2 (dense: trigger at the start),
    # 1 (down: wait only)
    consts = dict(GATED=gated, DENSE=dense, MODE=mode, BN=16, BK=256, SUM_EACH=sum_each,
                  PDL=3 if gated else 2 if dense else 1, TILE=0 if dense or mode == 0 else 64)
    pointers = {"a_ptr": "*bf16", "w_ptr": "*bf16" if mode == 0 else "*u8", "s_ptr": "*u8", "d_ptr": "*fp32",
                "out_ptr": "*bf16", "ids_ptr": "*i32", "topw_ptr": "*fp32"}
    signature = {n: "constexpr" if n in consts else pointers.get(n, "i32") for n in fn.arg_names}
    try:
        k = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts),
                           target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=3))
        ptx = k.asm["ptx"]
        wait = ptx.index("griddepcontrol.wait")
        launch = ptx.find("griddepcontrol.launch_dependents")
        results.append(dict(ok=bool(k.asm["cubin"]), prmt="prmt.b32" in ptx, error="",
                            launch=-1 if launch < 0 else int(launch > wait),  # -1 none, 0 before the wait, 1 after
                            loads_before_wait=ptx[:wait].count("ld.global"), cg_before_wait="ld.global.cg" in ptx[:wait]))
    except Exception as exc:
        results.append(dict(ok=False, prmt=False, error=f"{type(exc).__name__}: {exc}"[-2000:]))
print(json.dumps(results))
"""
GEMV_VARIANTS = [
    (7, "gemv gate/up"),
    (7, "gemv down"),
    (4, "gemv gate/up"),
    (0, "gemv bf16"),
    (0, "gemv dense"),
]


def _compile(script: str, variants: list) -> list[dict]:
    """Run a compile script in a subprocess without the interpreter; its last line of output, parsed."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-c", script, json.dumps(variants)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_expert_kernel_variants_compile_for_sm90():
    results = _compile(SCRIPT, VARIANTS)
    names = [*VARIANTS, "align 8", "align 512", "align 4096", *GEMV_VARIANTS]
    for variant, r in zip(names, results, strict=True):
        assert r["ok"], (variant, r["error"])
        if variant[0] == 7:
            assert r["prmt"], variant  # the inline PTX made it in
    gemv_results = results[-len(GEMV_VARIANTS) :]
    for (_, kind), r in zip(GEMV_VARIANTS, gemv_results, strict=True):
        # the early start: gate/up releases down after its wait, a dense GEMV at its start; down waits only.
        # Before the wait a gate/up program loads nothing; down and dense ones load their first tile (and
        # down its pair's expert id, through L2)
        assert r["launch"] == {"gemv gate/up": 1, "gemv bf16": 1, "gemv dense": 0, "gemv down": -1}[kind], (
            kind,
            r,
        )
        assert (r["loads_before_wait"] > 0) == (kind in ("gemv dense", "gemv down")), (kind, r)
        assert r["cg_before_wait"] == (kind == "gemv down"), (kind, r)


# what the Gluon expert kernels' compile scripts share: the imports, the pointer types of the expert kernels'
# arguments, and their machine code (spills are ptxas's: they show in the SASS)
GLUON_PREAMBLE = r"""
import json, os, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
POINTERS = {"a_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*u8", "d_ptr": "*fp32", "out_ptr": "*bf16", "order_ptr": "*i32",
            "blk_expert_ptr": "*i32", "blk_start_ptr": "*i32", "blk_count_ptr": "*i32", "nblk_ptr": "*i32",
            "topw_ptr": "*fp32"}


def sass_of(kernel):
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
"""

MMA_SCRIPT = (
    GLUON_PREAMBLE
    + r"""
from fp4moe.kernels import nvfp4_mma_gemv as mma

fn = mma._mma_gemv_kernel
results = []
for gated, pairs, k, wk, kc, rows, tile in json.loads(sys.argv[1]):
    consts = dict(K=k, GATED=gated, PAIRS=pairs, ROWS=32 if gated else rows, WK=wk, KC=kc, PDL=3 if gated else 1,
                  TILE=tile)
    signature = {n: "constexpr" if n in consts else POINTERS.get(n, "i32") for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n not in consts and n not in ("TOPK", "stride_de")}
    try:
        kern = triton.compile(GluonASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=wk))
        ptx = kern.asm["ptx"]
        wait = ptx.index("griddepcontrol.wait")
        launch = ptx.find("griddepcontrol.launch_dependents")
        sass = sass_of(kern)
        results.append(dict(ok=True, mma=ptx.count("mma.sync.aligned.m16n8k16"), prmt="prmt.b32" in ptx,
                            loads_before_wait=ptx[:wait].count("ld.global"),
                            cg_before_wait="ld.global.cg" in ptx[:wait],
                            launch=-1 if launch < 0 else int(launch > wait), hmma=sass.count("HMMA"),
                            spills=" STL" in sass or " LDL" in sass, error=""))
    except Exception as exc:
        results.append(dict(ok=False, error=f"{type(exc).__name__}: {exc}"[-2000:]))
print(json.dumps(results))
"""
)
# (gated, pairs, K, wk, kc, rows): the engine's launches on the full-size model (gate/up K = H = 2048, down K = I =
# 512; blocks of 8 pairs, and one pair per block at batch 1) and on the decode gate's tiny model (H = I = 64)
# and a tile step (expert_layout: the engine's experts are tiled at 64-byte steps at full size, 32 on the tiny
# model; 0 row-major)
MMA_VARIANTS = [
    (True, False, 2048, 2, 32, 16, 64),
    (False, False, 512, 1, 64, 16, 64),
    (False, True, 512, 1, 64, 16, 64),
    (True, False, 2048, 4, 32, 16, 0),
    (False, False, 512, 2, 32, 16, 0),
    (False, True, 512, 2, 64, 16, 0),
    (False, False, 512, 2, 32, 32, 0),
    (True, True, 2048, 4, 64, 16, 0),
    (True, False, 64, 1, 32, 16, 32),
    (False, False, 64, 1, 32, 16, 32),
]


@pytest.mark.slow
def test_tensor_core_gemv_compiles_for_sm90():
    """The Gluon kernel (no interpreter: this is the CPU's only check of it) compiles for the H200 with every
    layout change a no-op (``convert_layout(..., assert_trivial=True)`` fails the compile otherwise), one
    m16n8k16 MMA per 16 bytes of a row per matrix and parity, the inline-PTX dequantization, no spills, and
    only down programs reading before their wait (their expert and first weights)."""
    results = _compile(MMA_SCRIPT, MMA_VARIANTS)
    for (gated, _, k, wk, _, rows, _), r in zip(MMA_VARIANTS, results, strict=True):
        assert r["ok"], r["error"]
        rows_all = 32 if gated else rows
        # per warp: (rows / 16) M tiles x (K / 2 bytes / wk) / 16 bytes x 2 (even and odd weights)
        assert r["mma"] == (rows_all // 16) * (k // 2 // wk // 16) * 2, r
        assert r["hmma"] == r["mma"] and r["prmt"] and not r["spills"], r
        # gate/up reads nothing before its wait and then lets the down launch start; down reads its block's
        # expert (table entries through L2) and its first weights before the wait, and releases nothing
        assert (r["loads_before_wait"] > 0) == r["cg_before_wait"] == (not gated), r
        assert r["launch"] == (1 if gated else -1), r


ATTENTION_SCRIPT = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fp4moe.kernels import attention

results = []
for name, fp8 in json.loads(sys.argv[1]):
    fn = getattr(attention, name)
    cache = "*u8" if fp8 else "*bf16"
    # the full-size model's shapes: 16 q / 2 kv heads of 256, pages of 16 (decode) or 64 (prefill) tokens
    if name == "_decode_split_kernel":
        consts = dict(H=16, HKV=2, D=256, G=8, GP=16, PAGE=16, FP8=fp8, DOT_F32=False, PDL=True)
        warps, stages = 4, 2
    else:
        rows, cols, warps, stages = attention.PREFILL_TILES[fp8]
        consts = dict(H=16, HKV=2, D=256, G=8, TOK=rows // 8, BM=rows, BN=cols, PAGE=64, FP8=fp8, DOT_F32=False)
    pointers = {"q_ptr": "*bf16", "k_cache_ptr": cache, "v_cache_ptr": cache, "block_table_ptr": "*i32",
                "seq_lens_ptr": "*i32", "kv_scale_ptr": "*fp32", "part_o_ptr": "*fp32", "part_ml_ptr": "*fp32",
                "sm_scale": "fp32", "qk_scale": "fp32", "out_ptr": "*bf16", "blocks_ptr": "*i64",
                "slots_ptr": "*i64", "cached_ptr": "*i64", "starts_ptr": "*i32", "ends_ptr": "*i64"}
    signature = {n: "constexpr" if n in consts else pointers.get(n, "i32") for n in fn.arg_names}
    try:
        k = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts),
                           target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
        ptx = k.asm["ptx"]
        results.append(dict(ok=bool(k.asm["cubin"]), error="", e4m3_cvt="e4m3x2" in ptx, wgmma="wgmma" in ptx))
    except Exception as exc:
        results.append(dict(ok=False, error=f"{type(exc).__name__}: {exc}"[-2000:], e4m3_cvt=False, wgmma=False))
print(json.dumps(results))
"""


@pytest.mark.slow
def test_decode_attention_compiles_for_sm90_with_both_cache_dtypes():
    """The paged decode attention kernel for the H200, bf16 and fp8 caches: the fp8 one converts its bytes
    with the hardware's e4m3 conversion (its scales multiply scores and output, not each element)."""
    bf16, fp8 = _compile(ATTENTION_SCRIPT, [["_decode_split_kernel", False], ["_decode_split_kernel", True]])
    assert bf16["ok"], bf16["error"]
    assert fp8["ok"], fp8["error"]
    assert fp8["e4m3_cvt"] and not bf16["e4m3_cvt"]


@pytest.mark.slow
def test_paged_prefill_attention_compiles_for_sm90_with_both_cache_dtypes():
    """The paged prefill attention kernel for the H200 at the full-size shapes and its default tile, bf16
    and fp8 pages: its dots on Hopper's warpgroup tensor cores (wgmma), fp8 bytes through the hardware's
    e4m3 conversion."""
    bf16, fp8 = _compile(
        ATTENTION_SCRIPT, [["_prefill_paged_kernel", False], ["_prefill_paged_kernel", True]]
    )
    assert bf16["ok"], bf16["error"]
    assert fp8["ok"], fp8["error"]
    assert bf16["wgmma"] and fp8["wgmma"], (bf16, fp8)
    assert fp8["e4m3_cvt"] and not bf16["e4m3_cvt"]


PREFILL_SCRIPT = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fp4moe.kernels import nvfp4_gemm as gemm
from fp4moe.kernels import nvfp4_moe_prefill as prefill

fn = prefill._prefill_kernel
pointers = {"a_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*u8", "d_ptr": "*fp32", "out_ptr": "*bf16",
            "order_ptr": "*i32", "blk_expert_ptr": "*i32", "blk_start_ptr": "*i32", "blk_count_ptr": "*i32",
            "nblk_ptr": "*i32", "topw_ptr": "*fp32"}
results = []
for epilogue, bm in json.loads(sys.argv[1]):  # the default plan's tiles at this block size
    t = gemm.plan(bm, 8192 if bm == 128 else 2048)[epilogue - 1]
    consts = dict(MODE=7, EPILOGUE=epilogue, BM=bm, BN=t.bn, BK=t.bk, EVEN_N=True, DOT_F32=False, PDL=True, TILE=64,
                  WIDE=t.wide)
    signature = {n: "constexpr" if n in consts else pointers.get(n, "i32") for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n not in consts and n not in ("TOPK", "stride_de")}
    try:
        k = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs),
                           target=GPUTarget("cuda", 90, 32), options=dict(num_warps=t.warps, num_stages=t.stages))
        ttgir = k.asm["ttgir"]
        results.append(dict(ok=bool(k.asm["cubin"]), error="", weights_first=t.weights_first,
                            # the MMA's first operand in registers (wgmma with A from registers)
                            a_in_registers=bool(re.search(r"warp_group_dot %\S+, %\S+.*tensor<\d+x\d+xbf16, "
                                                          r"#ttg.dot_op<\{opIdx = 0", ttgir)),
                            prmt="prmt.b32" in k.asm["ptx"]))
    except Exception as exc:
        results.append(dict(ok=False, error=f"{type(exc).__name__}: {exc}"[-2000:]))
print(json.dumps(results))
"""


@pytest.mark.slow
def test_weights_first_prefill_experts_compile_for_sm90():
    """nvfp4_moe_prefill's kernel at the default plan's prefill tiles (64- and 128-pair blocks, gate/up and
    down): warpgroup MMAs whose first operand, the dequantized weights, stays in registers."""
    variants = [[1, 64], [2, 64], [1, 128], [2, 128]]
    for variant, r in zip(variants, _compile(PREFILL_SCRIPT, variants), strict=True):
        assert r["ok"], (variant, r["error"])
        assert r["weights_first"] and r["a_in_registers"] and r["prmt"], (variant, r)


WGMMA_SCRIPT = (
    GLUON_PREAMBLE
    + r"""
from fp4moe.kernels import nvfp4_wgmma as wg

fn = wg._wgmma_kernel
results = []
for gated, bm, tile, rows in json.loads(sys.argv[1]):
    # the full-size experts: gate/up K = 2048, down K = 512; the engine's 64-byte tile order, or row-major
    consts = dict(K=2048 if gated else 512, GATED=bool(gated), BM=bm, STAGES=wg.stages_for(bm, bool(gated), rows),
                  PERMUTE_OUT=bool(gated), PDL=1, TILE=tile, BN=rows)
    signature = {n: "constexpr" if n in consts else POINTERS.get(n, "i32") for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n not in consts and n not in ("TOPK", "stride_de")}
    try:
        k = triton.compile(GluonASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs),
                           target=GPUTarget("cuda", 90, 32), options=dict(num_warps=rows // 16))
        sass = sass_of(k)
        # HGMMA.64x128x16.F32.BF16 R24, R152, gdesc[UR12], R24: the accumulator, then A (a register, or gdesc[..]
        # for shared memory), then B
        hgmma = [line.split("HGMMA.")[1].split(";")[0] for line in sass.splitlines() if "HGMMA." in line]
        results.append(dict(ok=True, shared=k.metadata.shared, hgmma=len(hgmma),
                            register_a=sum(h.split(",")[1].strip().startswith("R") for h in hgmma),
                            spills=sum(op in sass for op in (" STL", " LDL")), error=""))
    except Exception as exc:
        results.append(dict(ok=False, error=f"{type(exc).__name__}: {exc}"[-2000:]))
print(json.dumps(results))
"""
)
# (gated, block rows, tile, weight rows a program)
WGMMA_VARIANTS = [
    (1, 128, 64, 64),
    (0, 128, 64, 64),
    (1, 64, 64, 64),
    (0, 64, 0, 64),
    (1, 128, 64, 128),
    (0, 128, 64, 128),
]


@pytest.mark.slow
def test_wgmma_prefill_kernels_compile_for_sm90_without_spills():
    """``nvfp4_wgmma``'s kernel (Gluon: no interpreter, so this is all CI can run of it) compiles for the H200 at
    its default ring depths: wgmma with the weights as the register operand, two programs' shared memory on an
    SM (one of 128 weight rows), and no register spills (its first version held the next step's code bytes in registers, one per byte,
    and spilled ~560 bytes a thread)."""
    results = _compile(WGMMA_SCRIPT, WGMMA_VARIANTS)
    for variant, r in zip(WGMMA_VARIANTS, results, strict=True):
        assert r["ok"], (variant, r["error"])
        assert r["hgmma"] > 0 and r["register_a"] == r["hgmma"], (variant, r)
        assert r["spills"] == 0, (variant, r)
        assert r["shared"] <= (228 * 1024 // 2 if variant[3] == 64 else 227 * 1024), (variant, r)


CONV_SCRIPT = (
    GLUON_PREAMBLE
    + r"""
from triton.compiler import ASTSource
from fp4moe.kernels import causal_conv as cc

POINTERS = {"x_ptr": "*bf16", "state_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "seq_ptr": "*i32",
            "start_ptr": "*i32", "eps": "fp32"}
results = []
for window, varlen, kd in json.loads(sys.argv[1]):
    fn = cc._conv_window_kernel if window else cc._causal_conv_kernel
    bt, bc, warps = cc.WINDOW_TILE if window else cc.TILE
    consts = dict(BT=bt, BC=bc, VARLEN=bool(varlen), PDL=1, KD=kd, **({} if window else {"KC": 4}))
    signature = {n: "constexpr" if n in consts else POINTERS.get(n, "i32") for n in fn.arg_names}
    # as the launcher specializes them for the full-size model: pointers, the row stride and the channel splits
    # multiples of 16 (the token count is not specialized)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n not in consts and n not in ("T", "eps")}
    try:
        k = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs),
                           target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
        sass = sass_of(k)
        results.append(dict(ok=True, spills=sum(op in sass for op in (" STL", " LDL")), error=""))
    except Exception as exc:
        results.append(dict(ok=False, error=f"{type(exc).__name__}: {exc}"[-2000:]))
print(json.dumps(results))
"""
)
CONV_VARIANTS = [
    (1, 1, 128),
    (1, 0, 0),
    (0, 1, 128),
]  # the window kernel as the engine launches it, and plain


@pytest.mark.slow
def test_conv_kernels_compile_for_sm90_without_spills():
    """The prefill conv kernels (``causal_conv``; the window kernel's rows unrolled) compile for the H200 with
    nothing spilled to local memory. (The taps kernel holds 184-252 registers a thread -- four taps of 32 elements
    in flight -- and spills ~290 bytes where the strides are not known to be multiples of 16.)"""
    results = _compile(CONV_SCRIPT, CONV_VARIANTS)
    for variant, r in zip(CONV_VARIANTS, results, strict=True):
        assert r["ok"], (variant, r["error"])
        assert r["spills"] == 0, (variant, r)
