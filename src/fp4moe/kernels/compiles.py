"""Triton compiles counted by kernel, so a server can tell when a request waited for the compiler.

Triton compiles a kernel once per specialization (constexprs, integers equal to 1 or divisible by 16,
pointers aligned to 16 bytes). The serve warm-up is meant to meet every variant before the first request;
one it missed costs a user 0.3-2 s the first time its shape comes up (the H200 server at 16 streams spent
64%, then 30%, of its engine thread in the compiler, issue 20). ``watch()`` installs Triton's
post-compile hook (chaining any hook already there); ``count()`` is the number of compiles so far, by
kernel name. The server ``mark()``s the count after its warm-up; every compile after the mark is logged as a
warning and counted in the ``fp4moe:kernel_compiles_after_warmup`` metric (``after_mark()``).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading

_counts: collections.Counter[str] = collections.Counter()
_lock = threading.Lock()
_installed = False
_mark: dict[str, int] | None = None
_specs: list[tuple[str, str, str]] = []  # (module, qualified name, Triton's specialization data) per compile


def watch() -> bool:
    """Start counting compiles in this process (idempotent). False when Triton is not installed."""
    global _installed
    try:
        from triton import knobs
    except ImportError:
        return False
    with _lock:
        if _installed:
            return True
        previous = knobs.runtime.jit_post_compile_hook

        def hook(*args, **kwargs):
            info = kwargs.get("fn")
            name = getattr(info, "name", None) or "unknown"
            spec = (kwargs.get("compile") or {}).get("specialization_data")
            with _lock:
                _counts[name] += 1
                if spec is not None and isinstance(getattr(info, "module", None), str):
                    _specs.append((info.module, name, spec))
                marked = _mark is not None
            if marked:
                logging.getLogger("fp4moe").warning(
                    "compiled the Triton kernel %s after the warm-up: a request waited for the compiler "
                    "(a shape the warm-up did not meet)",
                    name,
                )
            return previous(*args, **kwargs) if previous is not None else None

        knobs.runtime.jit_post_compile_hook = hook
        _installed = True
    return True


def specializations() -> list[tuple[str, str, str]]:
    """Every variant compiled (or loaded from the disk cache) since ``watch()``: (the kernel's module, its
    qualified name, Triton's specialization data) -- what ``kernels.compile_seeds`` records."""
    with _lock:
        return list(_specs)


def count() -> dict[str, int]:
    """Compiles seen since ``watch()``, by kernel name."""
    with _lock:
        return dict(_counts)


def since(before: dict[str, int]) -> dict[str, int]:
    """Compiles after the snapshot ``before`` (a ``count()``), by kernel name; kernels with none left out."""
    now = count()
    return {name: n - before.get(name, 0) for name, n in now.items() if n > before.get(name, 0)}


def mark() -> None:
    """Remember the count now (the end of a warm-up): later compiles are warned about."""
    global _mark
    snapshot = count()
    with _lock:
        _mark = snapshot


def after_mark() -> dict[str, int]:
    """Compiles since ``mark()``, by kernel name ({} before any mark)."""
    with _lock:
        before = _mark
    return {} if before is None else since(before)


class CompileWanted(RuntimeError):
    """Raised inside ``forbidden()`` where Triton was about to compile a kernel or benchmark an autotuner's
    configs: the caller must run the work eagerly first (a CUDA graph capture cannot compile)."""


@contextlib.contextmanager
def forbidden():
    """Within: Triton raises ``CompileWanted`` before it would compile a kernel variant (its cache hook,
    which runs before the compiler and before any CUDA call) or benchmark an autotuner's configs for a new
    key (its ``_bench``, which synchronizes the device). A CUDA graph captured without an eager run first
    is complete and valid when none is raised; where one is, nothing reached the stream that cannot be
    captured, so the capture ends cleanly and is thrown away. No-op without Triton. One thread at a time
    (the engine's warm-up)."""
    try:
        from triton import knobs
        from triton.runtime.autotuner import Autotuner
    except ImportError:
        yield
        return
    previous, bench = knobs.runtime.jit_cache_hook, Autotuner._bench

    def cache_hook(*args, **kwargs):
        raise CompileWanted(f"Triton would compile {getattr(kwargs.get('fn'), 'name', 'a kernel')}")

    def no_bench(self, *args, **kwargs):
        raise CompileWanted(
            f"Triton would autotune {getattr(getattr(self, 'base_fn', None), '__name__', 'a kernel')}"
        )

    knobs.runtime.jit_cache_hook, Autotuner._bench = cache_hook, no_bench
    try:
        yield
    finally:
        knobs.runtime.jit_cache_hook, Autotuner._bench = previous, bench
