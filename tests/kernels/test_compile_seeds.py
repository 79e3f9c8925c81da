"""Compile seeds (``kernels.compile_seeds``): recorded Triton variants compile in worker processes into the
disk cache, so the JIT's own compile of the same variant is a cache hit. On the CPU: Triton compiles for
the H200 (sm90) without a GPU, in a subprocess without the interpreter (the test session runs kernels under
it, which replaces every jitted function)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

SCRIPT = r"""
import json, pathlib, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.compiler import ASTSource
from triton.runtime.jit import serialize_specialization_data
from fp4moe.kernels import compile_seeds, moe_routing

root, cache = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
target = ("cuda", 90, 32)
fn = moe_routing._align_kernel
consts = {(fn.arg_names.index(n),): v for n, v in dict(E=256, BM=16, TKP=8, PDL=True).items()}
signature = {n: "constexpr" if (i,) in consts else ("i32" if n == "TK" else "*i32") for i, n in enumerate(fn.arg_names)}
attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if (i,) not in consts and n != "TK"}
options = CUDABackend(GPUTarget(*target)).parse_options(dict(num_warps=8))
# what Triton's post-compile hook hands ``compiles.watch``: the JIT's own serialization
spec = serialize_specialization_data(fn._fn_name, signature, consts, attrs, options, "key")
module = "fp4moe.kernels.moe_routing"
data = compile_seeds.record("Test GPU 1", [(module, "_align_kernel", spec), (module, "_gone", spec),
                                           (module, "_align_kernel", spec)], target)
path = compile_seeds.write(data, root)
entries = compile_seeds.load("Test GPU 1", target, root)
other = compile_seeds.load("Test GPU 1", ("cuda", 100, 32), root)
stale = {"module": module, "name": "_gone", "spec": spec}
job = compile_seeds.Precompile(entries + [stale], target, workers=2).wait()
before = sorted(str(p) for p in cache.rglob("*"))
k = triton.compile(ASTSource(fn, signature, consts, attrs), target=GPUTarget(*target), options=dict(num_warps=8))
after = sorted(str(p) for p in cache.rglob("*"))
print(json.dumps(dict(file=path.name, recorded=len(data["kernels"]), loaded=len(entries), other=len(other),
                      compiled=job.compiled, total=job.total, cubins=sum(p.endswith(".cubin") for p in before),
                      hit=before == after, ok=bool(k.asm["cubin"]))))
"""


def test_recorded_variants_compile_in_workers_into_the_cache_the_jit_reads(tmp_path):
    cache = tmp_path / "triton-cache"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache)
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "seeds"), str(cache)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["file"] == "compiles-Test_GPU_1.json"
    assert got["recorded"] == got["loaded"] == 1  # duplicates and kernels not found are left out
    assert got["other"] == 0  # another compile target: not used
    assert (got["compiled"], got["total"]) == (1, 2)  # the stale entry failed quietly
    assert got["cubins"] >= 1 and got["ok"]
    assert got[
        "hit"
    ]  # compiling the same variant here wrote nothing new: the workers' entry is the JIT's key


def test_a_cancelled_precompile_leaves_no_worker_and_no_file():
    from fp4moe.kernels import compile_seeds

    entries = [{"module": "fp4moe.kernels.moe_routing", "name": "_gone", "spec": "{}"}] * 4
    job = compile_seeds.Precompile(entries, ("cuda", 90, 32), workers=2)
    procs, path = list(job._procs), job._dir
    assert len(procs) == 2 and os.path.exists(path)
    job.cancel()
    assert all(p.poll() is not None for p in procs) and not os.path.exists(path)
    assert job.wait().compiled == 0  # nothing left to wait for
    late = compile_seeds.Precompile(entries, ("cuda", 90, 32), workers=2)
    procs = list(late._procs)
    assert late.wait(timeout=0).compiled == 0  # out of time at once: the workers stopped, not awaited
    assert all(p.poll() is not None for p in procs) and not os.path.exists(late._dir)


def test_workers_claim_each_variant_once(tmp_path):
    """A worker takes every variant no other worker has claimed (so one that drew cheap ones takes on more);
    a worker that finds them all claimed compiles nothing."""
    from fp4moe.kernels import compile_seeds

    entries = [{"module": "fp4moe.kernels.moe_routing", "name": "_gone", "spec": "{}"}] * 5
    (tmp_path / "entries.json").write_text(json.dumps({"target": ["cuda", 90, 32], "kernels": entries}))
    assert compile_seeds._worker(str(tmp_path), 2, 1) == 0  # stale entries: claimed, none compiles
    claims = sorted(p.name for p in tmp_path.glob("claim-*"))
    assert claims == [f"claim-{i}" for i in range(5)]
    assert compile_seeds._worker(str(tmp_path), 2, 0) == 0
    assert sorted(p.name for p in tmp_path.glob("claim-*")) == claims


SETTLE = r"""
import importlib, json, sys
for name in sys.argv[1:]:  # this process's import order
    importlib.import_module(name)
from fp4moe.kernels import compile_seeds, nvfp4_gemm, nvfp4_moe_prefill
n = compile_seeds.settle_cache_keys()
fns = [nvfp4_gemm._w4a16_kernel, nvfp4_moe_prefill._prefill_kernel]
print(json.dumps(dict(n=n, keys=[f.cache_key for f in fns],
                      globals=[sorted(name for name, _ in f.used_global_vals) for f in fns])))
"""


def test_settled_cache_keys_are_the_same_in_every_process():
    """Triton folds a helper's constexpr globals into a caller's key only where the helper was hashed
    first, so a kernel's key (and its disk-cache entry) depended on which kernels a process launched
    first; settled, callees before callers, they agree across import orders and hash seeds and take in
    every helper's globals (the dequantizing PTX string that ``_w4a16_kernel`` reaches through
    ``dequant_asm``)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    runs = []
    for seed, order in (
        ("1", ["fp4moe.kernels.nvfp4_gemm"]),
        ("2", ["fp4moe.kernels.attention", "fp4moe.kernels.nvfp4_moe_prefill"]),
    ):
        run = subprocess.run(
            [sys.executable, "-c", SETTLE, *order],
            env={**env, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stderr[-3000:]
        runs.append(json.loads(run.stdout.strip().splitlines()[-1]))
    a, b = runs
    assert a["n"] == b["n"] > 20
    assert a["keys"] == b["keys"]
    assert all("E2M1_BOTH" in names for names in a["globals"])


GLUON = r"""
import json, pathlib, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import convert_to_tuple_if_list
from fp4moe.kernels import compile_seeds

cache = pathlib.Path(sys.argv[1])
compile_seeds.settle_cache_keys()  # as the engine does before anything launches (compile_seeds.start)
entries = compile_seeds.load("NVIDIA H200", ("cuda", 90, 32))  # the committed seed file
entry = next(e for e in entries if e["name"] == "_mma_gemv_kernel")
job = compile_seeds.Precompile([entry], ("cuda", 90, 32), workers=1).wait()
before = sorted(str(p) for p in cache.rglob("*"))
# what the JIT compiles for this specialization: Gluon's source class, the recorded signature and constants
fn = compile_seeds.jit_function(entry["module"], entry["name"])
d = json.loads(entry["spec"])
consts = {tuple(k): triton.language.constexpr(v["constexpr"]) if isinstance(v, dict) else v
          for k, v in zip(d["constant_keys"], d["constant_vals"])}
attrs = {tuple(k): v for k, v in zip(d["attrs_keys"], d["attrs_vals"])}
signature = {k: convert_to_tuple_if_list(v) for k, v in d["signature"].items()}
options = {k: tuple(v) if isinstance(v, list) else v for k, v in d["options"].items() if k != "extern_libs"}
k = triton.compile(GluonASTSource(fn, signature, consts, attrs), target=GPUTarget("cuda", 90, 32), options=options)
after = sorted(str(p) for p in cache.rglob("*"))
print(json.dumps(dict(compiled=job.compiled, hit=before == after, ok=bool(k.asm["cubin"]))))
"""


def test_a_recorded_gluon_variant_compiles_in_a_worker():
    """The tensor-core GEMV is a Gluon kernel: compiled through Triton's plain source class it fails (the 3
    variants of 75 that did not precompile on the H200); through Gluon's, as the JIT does, one of the H200's
    recorded variants compiles and the JIT's compile of it is then a cache hit."""
    import tempfile

    from fp4moe.kernels import compile_seeds

    recorded = json.loads(compile_seeds.seed_path("NVIDIA H200").read_text())["triton"]
    if recorded != compile_seeds.triton_version():
        pytest.skip(f"the H200's seed file is for Triton {recorded}, not this one's")
    with tempfile.TemporaryDirectory() as tmp:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["TRITON_CACHE_DIR"] = tmp
        run = subprocess.run(
            [sys.executable, "-c", GLUON, tmp], env=env, capture_output=True, text=True, timeout=600
        )
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got == {"compiled": 1, "hit": True, "ok": True}


def test_a_second_recording_adds_to_the_first(tmp_path, monkeypatch):
    """One seed file for several recorded configurations: a recording with ``keep`` holds the variants
    already there for the GPU (once each) and the new ones, each tagged with the configurations that compiled
    it, and a start loads its own configuration's (an untagged entry, recorded before the tags, is
    everyone's); a file for another target is not merged."""
    from fp4moe.kernels import compile_seeds

    # the session runs Triton's interpreter, whose kernels are not JIT functions: every kernel is "found"
    monkeypatch.setattr(compile_seeds, "jit_function", lambda module, name: object())

    module, name, target = "fp4moe.kernels.moe_routing", "_align_kernel", ("cuda", 90, 32)
    first = compile_seeds.record("Test GPU 2", [(module, name, "a"), (module, name, "b")], target)
    compile_seeds.write(first, tmp_path)
    second = compile_seeds.record(
        "Test GPU 2", [(module, name, "b"), (module, name, "c")], target, keep=tmp_path, config="speculative"
    )
    assert [k["spec"] for k in second["kernels"]] == ["a", "b", "c"]
    assert [k["configs"] for k in second["kernels"]] == [["plain"], ["plain", "speculative"], ["speculative"]]
    second["kernels"].append({"module": module, "name": name, "spec": "old"})  # recorded before the tags
    compile_seeds.write(second, tmp_path)
    for config, specs in (("plain", "a b old"), ("speculative", "b c old"), (None, "a b c old")):
        loaded = compile_seeds.load("Test GPU 2", target, tmp_path, config)
        assert [k["spec"] for k in loaded] == specs.split(), config
    assert [compile_seeds.config_of(n) for n in (0, 2, "auto")] == ["plain", "speculative", None]
    with pytest.raises(ValueError, match="unknown configuration"):
        compile_seeds.record("Test GPU 2", [], target, config="prefix")
    other = compile_seeds.record("Test GPU 2", [(module, name, "c")], ("cuda", 100, 32), keep=tmp_path)
    assert [k["spec"] for k in other["kernels"]] == ["c"]


def test_every_shipped_variant_matches_its_kernels_parameters():
    """The shipped seed files (``data/compiles-*.json``) name each variant's parameters. One of our kernels whose
    parameters change leaves its entries compiling a variant nobody launches while the warm-up compiles the
    new one itself (a slower cold start): the file is re-recorded, or its entries updated, with the change.
    In a subprocess without the interpreter (its kernels are not JIT functions)."""
    script = r"""
import json, sys
from fp4moe.kernels import compile_seeds
from fp4moe.kernels.autotune_seeds import SEED_DIR
stale = []
for path in sorted(SEED_DIR.glob("compiles-*.json")):
    for k in json.loads(path.read_text())["kernels"]:
        if not k["module"].startswith("fp4moe."):  # flash-linear-attention's: not installed here
            continue
        fn = compile_seeds.jit_function(k["module"], k["name"])
        params = list(json.loads(k["spec"])["signature"])
        if fn is None or params != list(fn.arg_names):
            stale.append([path.name, k["name"], params, None if fn is None else list(fn.arg_names)])
print(json.dumps(stale))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == []
