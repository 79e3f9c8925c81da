"""The kernels beyond the H200 (``kernels.gpu_arch``): e4m3 converted by bits where the GPU has no
instruction for it (Ampere), equal bit for bit to the hardware's conversion (every byte; a sweep of fp32
values for the cache writes); the choices that follow a GPU's compute capability; the expert GEMM's stages
cut to a GPU's shared memory; and every kernel variant the engine records on the H200 compiling for sm80
and sm86 (with Ampere's settings), sm89 and sm120, each within its shared memory -- on the CPU, as the sm90 compile
tests do (tests/kernels/test_compile_sm90.py). Exact comparisons throughout: the conversions are exact."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from kernel_refs import BF16, DEV  # noqa: E402
from test_compile_sm90 import _compile  # noqa: E402

from fp4moe.kernels import gpu_arch  # noqa: E402
from fp4moe.kernels import nvfp4_gemm as gemm  # noqa: E402
from fp4moe.kernels.tl_helpers import e4m3_to_f16, fp8e4m3_bytes  # noqa: E402

E4M3 = torch.float8_e4m3fn


@triton.jit
def _to_f16_kernel(b_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, e4m3_to_f16(tl.load(b_ptr + i)))


@triton.jit
def _to_bytes_kernel(x_ptr, out_ptr, N: tl.constexpr, SOFT: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, fp8e4m3_bytes(tl.load(x_ptr + i), SOFT))


def test_e4m3_by_bits_is_the_conversion_for_every_byte():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    out = torch.empty(256, dtype=torch.float16, device=DEV)
    _to_f16_kernel[(1,)](codes.to(DEV), out, N=256)
    out = out.cpu()
    want = codes.view(E4M3).to(torch.float16)
    real = ~torch.isnan(want)  # 0x7f and 0xff: e4m3's NaN, which scales and caches never hold
    assert int(real.sum()) == 254
    assert torch.equal(out[real].view(torch.int16), want[real].view(torch.int16))  # -0 stays -0


def _fp32_sweep() -> torch.Tensor:
    """fp32 values within +-448: every e4m3 value, the midpoints between neighbours (ties to even), values
    just off them, random ones over the whole range (subnormals too), zeros."""
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(E4M3).float()
    grid = grid[~torch.isnan(grid)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    gen = torch.Generator().manual_seed(0)
    rand = torch.exp2(torch.rand(4096, generator=gen) * 20 - 11) * torch.randn(4096, generator=gen).sign()
    near = torch.cat([mids * (1 + 2.0**-20), mids * (1 - 2.0**-20)])
    x = torch.cat([grid, mids, near, rand.clamp(-448, 448), torch.tensor([0.0, -0.0, 448.0, -448.0])])
    return x.float()


def test_cache_bytes_by_bits_are_the_native_cast():
    x = _fp32_sweep()
    n = triton.next_power_of_2(x.numel())
    x = torch.cat([x, torch.zeros(n - x.numel())])
    native, soft = (torch.empty(n, dtype=torch.uint8, device=DEV) for _ in range(2))
    _to_bytes_kernel[(1,)](x.to(DEV), native, N=n, SOFT=False)
    _to_bytes_kernel[(1,)](x.to(DEV), soft, N=n, SOFT=True)
    native, soft = native.cpu(), soft.cpu()
    assert torch.equal(soft, native)
    # torch's round-to-nearest-even cast gives the same values; negatives that round to zero are +0 here
    # (the fp32 rounding's (x + magic) - magic), -0 in torch: the same value in every product
    assert torch.equal(soft.view(E4M3).float(), x.to(E4M3).float())


def test_fp8_linear_by_bits_equals_the_native_one(monkeypatch):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 96, generator=gen).to(BF16).to(DEV)
    w = (torch.randn(48, 96, generator=gen) * 40).to(E4M3).to(DEV)
    scale = torch.tensor(0.03, device=DEV)
    native = gemm.fp8_linear(x, w, scale)
    monkeypatch.setattr(gpu_arch, "SOFT_FP8", True)
    assert torch.equal(gemm.fp8_linear(x, w, scale), native)


@pytest.mark.parametrize(
    "cap,fp8,flag", [((8, 0), False, gpu_arch.SOFT), ((8, 6), False, gpu_arch.SOFT), ((8, 9), True, True),
                     ((9, 0), True, True), ((12, 1), True, True)],
)  # fmt: skip
def test_the_fp8_path_follows_the_compute_capability(monkeypatch, cap, fp8, flag):
    monkeypatch.setattr(
        gpu_arch, "SOFT_FP8", False
    )  # as without FP4MOE_SOFT_FP8 (the GPU tests run it set too)
    monkeypatch.setattr(gpu_arch, "capability", lambda index: cap)
    gpu = torch.device("cuda", 0)
    assert gpu_arch.has_fp8(gpu) is fp8
    assert gpu_arch.fp8_flag(gpu) is flag
    gpu_arch.check(gpu)  # sm80 and later run
    monkeypatch.setattr(gpu_arch, "SOFT_FP8", True)  # FP4MOE_SOFT_FP8=1: by bits everywhere
    assert gpu_arch.fp8_flag(gpu) == gpu_arch.SOFT and not gpu_arch.has_fp8(torch.device("cpu"))


def test_a_gpu_below_sm80_is_refused_with_its_name(monkeypatch):
    monkeypatch.setattr(gpu_arch, "capability", lambda index: (7, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-32GB")
    refused = r"compute capability 8\.0 or later.*Tesla V100-SXM2-32GB \(7\.0\)"
    with pytest.raises(RuntimeError, match=refused):
        gpu_arch.check(torch.device("cuda", 0))
    gpu_arch.check(torch.device("cpu"))  # the CPU engine: nothing to check


def test_stages_are_cut_to_the_gpus_shared_memory():
    # a decode gate/up tile of bf16 experts (the MTP head's): 16 x 256 activations, 2 x 64 x 256 weights
    stage = gemm.stage_bytes(16, 64, 256, 0, True)
    assert stage == 73_728  # sm90's compile: 147,456 bytes at 3 stages (two buffers)
    assert gpu_arch.fit_stages(3, stage, 232_448) == 3  # H200: as tuned
    assert gpu_arch.fit_stages(3, stage, 166_912) == 3  # A100
    assert gpu_arch.fit_stages(3, stage, 101_376) == 2  # Ada, RTX 50xx, GB10
    assert gpu_arch.fit_stages(3, stage, 65_536) == 1
    assert gpu_arch.fit_stages(4, stage, None) == 4  # the interpreter
    nvfp4 = 16 * 256 * 2 + 2 * 64 * (128 + 16)  # NVFP4: codes and block scales
    assert gemm.stage_bytes(16, 64, 256, 7, True) == nvfp4


# Every fp4moe variant the H200's engine records (kernels/compile_seeds.py), compiled for another GPU: the
# first of each kernel and dequantization mode. Below sm90 no PDL; sm80 gets Ampere's constexprs (NVFP4
# mode 1, FP8 weights mode 2, an fp8 cache converted by bits), and the Gluon kernels, which need sm89, are
# left out (dispatch keeps them off there). The expert GEMM's stages are cut as the launcher cuts them for the GPU's shared memory.
ARCH_SCRIPT = r"""
import json, sys
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import convert_to_tuple_if_list
from fp4moe.kernels import compile_seeds, gpu_arch
from fp4moe.kernels import nvfp4_gemm as gemm

arch, limit = json.loads(sys.argv[1])
seeds = json.loads(compile_seeds.seed_path("NVIDIA H200").read_text())["kernels"]
seen, results = set(), []
for e in seeds:
    if not e["module"].startswith("fp4moe."):
        continue
    fn = compile_seeds.jit_function(e["module"], e["name"])
    spec = json.loads(e["spec"])
    names = list(spec["signature"])
    consts = {}
    for k, v in zip(spec["constant_keys"], spec["constant_vals"]):
        consts[names[k[0]]] = v["constexpr"] if isinstance(v, dict) and "constexpr" in v else v
    key = (e["name"], consts.get("MODE"), consts.get("FP8"), consts.get("EPILOGUE"), consts.get("DENSE"))
    if key in seen or (arch < 89 and fn.is_gluon()):
        continue
    seen.add(key)
    opts = {k: tuple(v) if isinstance(v, list) else v for k, v in spec["options"].items()}
    for k in ("extern_libs", "arch", "supported_fp8_dtypes", "deprecated_fp8_dot_operand_dtypes"):
        opts.pop(k, None)
    if arch < 90 and "PDL" in consts:  # programmatic dependent launch is Hopper's (kernels.pdl_args)
        consts["PDL"] = 0
        opts["launch_pdl"] = False
    if arch < 89:
        if consts.get("MODE") in (3, 4, 7):
            consts["MODE"] = {7: 1, 4: 1, 3: 2}[consts["MODE"]]
        if consts.get("FP8") is True:
            consts["FP8"] = gpu_arch.SOFT
    recorded = opts["num_stages"]
    if e["name"] == "_w4a16_kernel":
        stage = gemm.stage_bytes(consts["BM"], consts["BN"], consts["BK"], consts["MODE"], consts["EPILOGUE"] == gemm.GATED)
        opts["num_stages"] = gpu_arch.fit_stages(recorded, stage, limit)
    cut = recorded - opts["num_stages"]
    source = ASTSource
    if fn.is_gluon():
        from triton.experimental.gluon._runtime import GluonASTSource as source
    values = [tl.dtype(v) if tl.dtype.is_dtype(v) else v for v in consts.values()]
    constexprs = {(names.index(n),): v for n, v in zip(consts, values)}
    attrs = {tuple(k): v for k, v in zip(spec["attrs_keys"], spec["attrs_vals"])}
    signature = {k: convert_to_tuple_if_list(v) for k, v in spec["signature"].items()}
    try:
        k = triton.compile(source(fn, signature, constexprs, attrs), target=GPUTarget("cuda", arch, 32), options=opts)
        results.append([e["name"], consts.get("MODE"), k.metadata.shared, cut, ""])
    except Exception as ex:
        results.append([e["name"], consts.get("MODE"), 0, cut, (type(ex).__name__ + ": " + str(ex))[-300:]])
print(json.dumps(results))
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch,limit",
    [(80, 166_912), (86, 101_376), (89, 101_376), (120, 101_376)],
    ids=["sm80 A100", "sm86 RTX 30xx", "sm89 Ada", "sm120 RTX 50xx"],
)
def test_the_engines_kernels_compile_for_other_gpus(arch, limit):
    results = _compile(ARCH_SCRIPT, [arch, limit])
    assert len(results) >= 20, results  # every kernel the engine launches on the H200, and their modes
    failed = [r for r in results if r[4]]
    assert not failed, failed
    over = [r for r in results if r[2] > limit]
    assert not over, over
    # only bf16 expert tiles lose stages (the MTP head's decode gate/up: 144 KB at the H200's 3), and only
    # where a program gets less than that
    cut = [r[:2] for r in results if r[3]]
    assert all(c == ["_w4a16_kernel", 0] for c in cut) and (limit < 147_456 or not cut), cut


def test_the_sweep_holds_every_e4m3_value():
    """The sweep above reaches every code (guards the test itself)."""
    x = _fp32_sweep()
    assert len(set(x.to(E4M3).view(torch.uint8).tolist())) == 254
    assert json.dumps(gpu_arch.SOFT) == "2"
