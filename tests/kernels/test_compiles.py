"""``compiles.forbidden``: inside it Triton raises before it would compile or autotune (so a CUDA graph
capture can go without an eager run first); outside it, Triton's hooks are as they were."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from triton import knobs  # noqa: E402
from triton.runtime.autotuner import Autotuner  # noqa: E402

from fp4moe.kernels import compiles  # noqa: E402


def test_forbidden_raises_before_a_compile_or_a_benchmark_and_restores_the_hooks():
    def mine(*args, **kwargs):
        return None

    before_hook, before_bench = mine, Autotuner._bench
    knobs.runtime.jit_cache_hook = mine
    try:
        with compiles.forbidden():
            with pytest.raises(compiles.CompileWanted):
                knobs.runtime.jit_cache_hook(key=None, repr="", fn=None, compile={}, is_manual_warmup=False)
            with pytest.raises(compiles.CompileWanted):
                Autotuner._bench(object.__new__(Autotuner), config=None)
        assert knobs.runtime.jit_cache_hook is before_hook and Autotuner._bench is before_bench
        with pytest.raises(ZeroDivisionError), compiles.forbidden():  # restored on an error too
            raise ZeroDivisionError
        assert knobs.runtime.jit_cache_hook is before_hook and Autotuner._bench is before_bench
    finally:
        knobs.runtime.jit_cache_hook = None
