"""Recorded autotuning winners go back into a fresh process's autotuners, and only where they can be
trusted (kernels.autotune_seeds). A stand-in package with real Triton autotuners: nothing launches."""

import json
import sys
import types

import pytest

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from fp4moe.kernels import autotune_seeds  # noqa: E402

CONFIGS = [triton.Config({"B": b}, num_warps=w) for b in (16, 32) for w in (1, 2)]


def _kernels():
    """Two kernels as fla declares them: one under ``triton.heuristics``, one bare."""

    @triton.heuristics({"X": lambda args: 1})
    @triton.autotune(configs=list(CONFIGS), key=["n"])
    @triton.jit
    def wrapped(x, n, B: tl.constexpr, X: tl.constexpr):
        pass

    @triton.autotune(configs=list(CONFIGS), key=["n"])
    @triton.jit
    def bare(x, n, B: tl.constexpr):
        pass

    return wrapped, bare


@pytest.fixture
def package(monkeypatch):
    """A fresh package ``fakefla`` (version 1.0) with a module ``fakefla.ops`` holding both kernels, and
    an alias of one of them in ``fakefla.more`` (re-exported, as fla's ``__init__`` files do)."""

    def install():
        wrapped, bare = _kernels()
        pkg = types.ModuleType("fakefla")
        pkg.__version__ = "1.0"
        ops = types.ModuleType("fakefla.ops")
        ops.wrapped, ops.bare = wrapped, bare
        more = types.ModuleType("fakefla.more")
        more.alias = bare
        for name, mod in (("fakefla", pkg), ("fakefla.ops", ops), ("fakefla.more", more)):
            monkeypatch.setitem(sys.modules, name, mod)
        return wrapped.fn, bare  # the autotuners

    return install


def test_recorded_winners_seed_a_fresh_process(package, tmp_path):
    wrapped, bare = package()
    wrapped.cache[(64, "torch.bfloat16")] = wrapped.configs[3]
    bare.cache[(8, "torch.float32")] = bare.configs[1]
    bare.cache[(4096, "torch.float32")] = bare.configs[2]
    data = autotune_seeds.record("NVIDIA H200", "fakefla")
    assert data["versions"]["fakefla"] == "1.0"
    # each autotuner once, the heuristics-wrapped one found through its fn, the alias not again
    assert sorted(data["kernels"]) == ["fakefla.more:alias", "fakefla.ops:wrapped"]
    path = autotune_seeds.write(data, tmp_path)
    assert path.name == "autotune-NVIDIA_H200.json" and not list(tmp_path.glob("*.tmp"))

    wrapped, bare = package()  # a new process: new autotuners, nothing tuned
    assert autotune_seeds.seed("NVIDIA H200", "fakefla", tmp_path) == 3
    assert wrapped.cache == {(64, "torch.bfloat16"): wrapped.configs[3]}
    # the autotuner's own config objects, under tuple keys as Triton builds them
    assert bare.cache[(8, "torch.float32")] is bare.configs[1]
    assert bare.cache[(4096, "torch.float32")] is bare.configs[2]


def test_a_seed_is_used_only_where_it_can_be_trusted(package, tmp_path):
    wrapped, bare = package()
    wrapped.cache[(64, "torch.bfloat16")] = wrapped.configs[0]
    bare.cache[(8, "torch.float32")] = bare.configs[0]
    data = autotune_seeds.record("NVIDIA H200", "fakefla")
    autotune_seeds.write(data, tmp_path)

    wrapped, bare = package()
    assert autotune_seeds.seed("NVIDIA H100 80GB HBM3", "fakefla", tmp_path) == 0  # another GPU: no file
    sys.modules["fakefla"].__version__ = "1.1"  # another version of the library
    assert autotune_seeds.seed("NVIDIA H200", "fakefla", tmp_path) == 0
    assert wrapped.cache == {} and bare.cache == {}

    # a config the kernel no longer lists, a kernel that is gone, a key tuned already: each skipped alone
    sys.modules["fakefla"].__version__ = "1.0"
    changed = json.loads(autotune_seeds.seed_path("NVIDIA H200", tmp_path).read_text())
    changed["kernels"]["fakefla.ops:wrapped"][0]["config"]["kwargs"]["B"] = 128
    changed["kernels"]["fakefla.ops:gone"] = changed["kernels"]["fakefla.more:alias"]
    autotune_seeds.write(changed, tmp_path)
    mine = bare.configs[3]
    bare.cache[(8, "torch.float32")] = mine
    assert autotune_seeds.seed("NVIDIA H200", "fakefla", tmp_path) == 0
    assert wrapped.cache == {} and bare.cache == {(8, "torch.float32"): mine}


def test_a_damaged_seed_file_is_a_clear_error(package, tmp_path):
    package()
    autotune_seeds.seed_path("NVIDIA H200", tmp_path).write_text('{"gpu": "NVIDIA H200", ')
    with pytest.raises(ValueError, match="not a valid autotune seed file"):
        autotune_seeds.seed("NVIDIA H200", "fakefla", tmp_path)


def _file(gpu="G", versions=None, **kernels):
    return {"gpu": gpu, "package": "fla", "versions": versions or {"triton": "3", "fla": "1"},
            "kernels": {k: [{"key": list(key), "config": {"n": c}} for key, c in v] for k, v in kernels.items()}}  # fmt: skip


def test_merge_keeps_old_keys_and_takes_new_winners():
    """A re-tune at another size replaces the keys it tuned, keeps the rest, adds new kernels; a file of
    another GPU or other versions is not mixed in."""
    old = _file(a=[((1, "x"), 1), ((2, "x"), 2)], b=[((1,), 5)])
    new = _file(a=[((2, "x"), 9), ((3, "x"), 3)], c=[((7,), 7)])
    got = autotune_seeds.merge(old, new)
    pairs = {k: {tuple(e["key"]): e["config"]["n"] for e in v} for k, v in got["kernels"].items()}
    assert pairs == {"a": {(1, "x"): 1, (2, "x"): 9, (3, "x"): 3}, "b": {(1,): 5}, "c": {(7,): 7}}
    assert autotune_seeds.merge(_file(gpu="H", a=[((1, "x"), 1)]), new) == new
    assert autotune_seeds.merge(_file(versions={"triton": "2"}, b=[((1,), 5)]), new) == new
    assert autotune_seeds.merge(None, new) == new
