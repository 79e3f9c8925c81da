"""Triton kernel variants recorded once per GPU and compiled in parallel at start-up, so a cold start's
warm-up finds them in Triton's disk cache instead of compiling them one after another.

A cold full-size start-up on the H200 spent 48-58 s of its ~93 s warm-up in Triton's compiler (the module
path, BENCHMARKS.md "Start-up"), one kernel variant at a time on one core of sixteen; a warm cache took
12-15 s for the same phase. Triton names every variant it compiles by its specialization (signature,
constexprs, alignment attributes, options: ``specialization_data``, what its own ``JITFunction.preload``
takes). ``kernels.compiles.watch`` keeps them as the warm-up compiles; ``record`` writes them with the GPU's
compile target (``benchmarks/startup.py --record-compiles``); ``Precompile`` compiles them in worker
processes while the model loads -- each worker calls ``triton.compile`` exactly as the JIT would for that
specialization (the same source, target and options; the kernels' own keys settled the same way in every
process, ``settle_cache_keys``: the same cache key), so the JIT's own compile later is a disk-cache hit
(H200: 75 of 75 in 18 s beside the load, a cold start 136 -> 71 s). Nothing depends on it being right: a
variant the code no longer asks for is a compile wasted, one it asks for anew compiles as before, an entry
that no longer compiles (a kernel renamed) is skipped. Used only for the recorded GPU's target and Triton
version. A cache-warming idea Triton supports (``jit_cache_hook`` / ``preload``), spread over processes.

Each variant is tagged with the configurations whose warm-up compiled it (``CONFIGS``: plain decoding, and
speculative as recorded with ``--num-speculative-tokens 2``: the decode kernel's conv ring is 4 + k long, so
another k compiles its own), and a start compiles only its own configuration's: a plain server precompiling
the speculative one's too (115 variants against 78) started in 103 s against 83 (H200, 2026-12-04). "auto"
(speculation only if the model has an MTP head, known after loading) takes every variant. Entries recorded
before the tags count for every configuration.
"""

from __future__ import annotations

import importlib
import json
import os
import time
from pathlib import Path

from fp4moe.kernels.autotune_seeds import SEED_DIR, gpu_file, read_seed, triton_version, write_whole


def seed_path(gpu_name: str, root: Path = SEED_DIR) -> Path:
    """The compile seed file of a GPU: ``compiles-<name with non-alphanumerics as _>.json``."""
    return gpu_file("compiles", gpu_name, root)


def jit_function(module: str, name: str):
    """The ``triton.jit`` function bound as ``name`` (a qualified name) in ``module``, unwrapped from the
    autotuners and heuristics around it; None where there is none (a kernel made inside a function)."""
    from triton.runtime.jit import JITFunction

    try:
        obj = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
    except Exception:  # noqa: BLE001 -- gone, renamed, or a module that no longer imports: not found
        return None
    return obj if isinstance(obj, JITFunction) else _unwrapped(obj)


def _callees(fn) -> list:
    """The ``triton.jit`` functions ``fn``'s body names (``name`` or ``module.name``), as Triton's own
    dependency walk finds them."""
    import ast
    import types

    from triton.runtime.jit import JITCallable

    found = []
    for node in ast.walk(fn.parse()):
        obj = None
        if isinstance(node, ast.Name):
            obj = fn.__globals__.get(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            base = fn.__globals__.get(node.value.id)
            obj = getattr(base, node.attr, None) if isinstance(base, types.ModuleType) else None
        if isinstance(obj, JITCallable) and obj is not fn:
            found.append(obj)
    return found


def settle_cache_keys(package: str = "fp4moe.kernels") -> int:
    """Compute the cache key of every ``triton.jit`` function in ``package``'s modules, callees before
    callers -> how many. Triton 3.6 hashes a kernel the first time it is launched, and folds in the
    constexpr globals of the helpers it calls only where a helper was already hashed (``_update_hash``
    reads the callee's globals before it asks for its key): the same kernel gets a different key, so
    misses the disk cache, depending on which kernels a process launched first (the precompile workers'
    ``_w4a16_kernel`` and ``_prefill_kernel`` missed the engine's until this). Settling the keys in one
    order before anything launches gives every process the same keys. A key already computed stays. None
    under Triton's interpreter (its functions have no keys)."""
    import pkgutil

    from fp4moe.kernels import INTERPRET

    if INTERPRET:
        return 0

    from triton.runtime.jit import JITCallable

    roots = []
    for info in pkgutil.iter_modules(importlib.import_module(package).__path__):
        try:
            module = importlib.import_module(f"{package}.{info.name}")
        except Exception:  # noqa: BLE001 -- a module that does not import here launches nothing either
            continue
        roots += [v if isinstance(v, JITCallable) else _unwrapped(v) for v in vars(module).values()]
    done: set[int] = set()

    def visit(fn) -> None:
        if id(fn) in done:
            return
        done.add(id(fn))
        for callee in _callees(fn):
            visit(callee)
        fn.cache_key  # noqa: B018 -- computed (and kept) now, after its callees'

    for fn in roots:
        if fn is not None:
            try:
                visit(fn)
            except Exception:  # noqa: BLE001 -- one Triton cannot hash here: it keys it at launch, as before
                continue
    return len(done)


def _unwrapped(obj):
    """The ``triton.jit`` function inside autotuners and heuristics, else None."""
    from triton.runtime.jit import JITFunction

    for _ in range(4):
        try:
            obj = getattr(obj, "fn", None)
        except Exception:  # noqa: BLE001 -- an object whose attributes are computed: no kernel
            return None
        if isinstance(obj, JITFunction):
            return obj
    return None


def cuda_target(device) -> tuple[str, int, int]:
    """Triton's compile target for a CUDA device: (backend, arch as major * 10 + minor, warp size)."""
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    return ("cuda", major * 10 + minor, 32)


CONFIGS = ("plain", "speculative")


def config_of(num_speculative_tokens) -> str | None:
    """The recorded configuration an engine with ``num_speculative_tokens`` (an int or "auto") starts as;
    None (every configuration's variants) for "auto", which speculates only where the model has an MTP head."""
    if num_speculative_tokens == "auto":
        return None
    return "plain" if num_speculative_tokens == 0 else "speculative"


def record(
    gpu_name: str,
    specializations: list[tuple[str, str, str]],
    target: tuple[str, int, int],
    keep: Path | None = None,
    config: str = "plain",
) -> dict:
    """The seed file's content: the compiled variants (module, qualified name, Triton's specialization data,
    from ``compiles.specializations()``) that a fresh process can find again, each tagged with ``config`` (one
    of ``CONFIGS``: the configuration whose warm-up compiled it), with the GPU, its compile target (backend,
    arch, warp size) and Triton's version. ``keep``: a seed folder whose variants for this GPU (same target and
    Triton) stay in, with their tags -- one file for several recorded configurations, each start compiling
    its own."""
    if config not in CONFIGS:
        raise ValueError(f"unknown configuration {config!r}: one of {CONFIGS}")
    tags: dict[tuple[str, str, str], set[str]] = {}
    for e in load(gpu_name, target, keep) if keep else []:
        tags.setdefault((e["module"], e["name"], e["spec"]), set()).update(e.get("configs", CONFIGS))
    for key in specializations:
        tags.setdefault(tuple(key), set()).add(config)
    kernels = [
        {"module": module, "name": name, "spec": spec, "configs": sorted(tags[(module, name, spec)])}
        for module, name, spec in tags
        if jit_function(module, name) is not None
    ]
    kernels.sort(key=lambda k: (k["module"], k["name"], k["spec"]))
    return {"gpu": gpu_name, "triton": triton_version(), "target": list(target), "kernels": kernels}


def write(data: dict, root: Path) -> Path:
    """``record``'s result to its seed file under ``root`` (written whole, then renamed)."""
    return write_whole(seed_path(data["gpu"], root), data, indent=0)


def load(
    gpu_name: str, target: tuple[str, int, int], root: Path = SEED_DIR, config: str | None = None
) -> list[dict]:
    """The recorded variants for ``gpu_name`` where they hold (the same compile target and Triton version),
    else []; with ``config`` only that configuration's (and untagged ones)."""
    data = read_seed(seed_path(gpu_name, root), "compile")
    if (
        data is None
        or data.get("triton") != triton_version()
        or tuple(data.get("target", ())) != tuple(target)
    ):
        return []
    return [e for e in data.get("kernels", []) if config is None or config in e.get("configs", CONFIGS)]


def compile_entry(entry: dict, target: tuple[str, int, int]) -> bool:
    """Compile one recorded variant for ``target`` into Triton's disk cache, as the JIT (``preload``)
    would -> whether it compiled (False: the kernel is gone or no longer takes that specialization)."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import convert_to_tuple_if_list

    fn = jit_function(entry["module"], entry["name"])
    if fn is None:
        return False
    source = ASTSource
    if fn.is_gluon():  # the JIT's source class for Gluon kernels (set on a kernel at its first launch)
        from triton.experimental.gluon._runtime import GluonASTSource as source

    def constexpr(value):
        if tl.dtype.is_dtype(value):
            return tl.dtype(value)
        if isinstance(value, dict) and "constexpr" in value:
            return tl.constexpr(value["constexpr"])
        return value

    try:
        d = json.loads(entry["spec"])
        if d.get("name") != fn._fn_name:
            return False
        consts = {tuple(k): constexpr(v) for k, v in zip(d["constant_keys"], d["constant_vals"], strict=True)}
        attrs = {tuple(k): v for k, v in zip(d["attrs_keys"], d["attrs_vals"], strict=True)}
        signature = {k: convert_to_tuple_if_list(v) for k, v in d["signature"].items()}
        options = {k: tuple(v) if isinstance(v, list) else v for k, v in d["options"].items()}
        if not all(os.path.exists(path) for _, path in options.get("extern_libs") or ()):
            options.pop("extern_libs")  # recorded on another install: the backend's own (keyed by content)
        triton.compile(source(fn, signature, consts, attrs), target=GPUTarget(*target), options=options)
    except Exception:  # noqa: BLE001 -- a stale entry: the JIT compiles what it needs itself
        return False
    return True


class Precompile:
    """The recorded variants compiling in ``workers`` processes from now on; ``wait`` blocks until they are
    in the disk cache. Plain subprocesses (``python -m fp4moe.kernels.compile_seeds``), not
    multiprocessing's: the server's engine runs in a daemonic process, which multiprocessing lets have no
    children. They see the GPU as the engine does (compiling needs none, the target is given, but
    flash-linear-attention reads the device at import and its kernels' cache keys take in what it found)
    and allocate nothing on it; the engine starts them as it begins loading the model and waits for them
    before it sizes its KV cache by the GPU's free memory (a CUDA context a worker may have made is gone
    by then). The work is shared out as it goes: each worker claims the next unclaimed variant (a file
    created exclusively in the job's folder), starting at its own place in the list, so a worker that drew
    cheap variants takes on more (a fixed share each left the job waiting on the worker with the slowest).
    Stopped at exit. A no-op with no entries."""

    def __init__(self, entries: list[dict], target: tuple[str, int, int], workers: int | None = None):
        import subprocess
        import sys
        import tempfile

        self.total, self.compiled, self.seconds = len(entries), 0, 0.0
        self._start = time.perf_counter()
        self._procs: list = []
        if not entries:
            return
        workers = max(1, min(workers or (os.cpu_count() or 2) - 1, len(entries)))
        self._dir = tempfile.mkdtemp(prefix="fp4moe-compiles-")
        (Path(self._dir) / "entries.json").write_text(
            json.dumps({"target": list(target), "kernels": entries})
        )
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the engine's environment
        cmd = [sys.executable, "-m", "fp4moe.kernels.compile_seeds", self._dir, str(workers)]
        self._procs = [
            subprocess.Popen(
                [*cmd, str(i)], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
            )
            for i in range(workers)
        ]
        import atexit

        atexit.register(self.cancel)

    def wait(self, timeout: float = 600.0) -> Precompile:
        """Until every variant has compiled (or failed), ``timeout`` seconds from the start at most (then the
        rest is dropped: the JIT compiles what it meets itself); the workers are then gone. Idempotent."""
        import subprocess

        if self._procs:
            for p in self._procs:
                try:
                    out, _ = p.communicate(timeout=max(0.0, self._start + timeout - time.perf_counter()))
                except subprocess.TimeoutExpired:
                    break
                last = (out.strip().splitlines() or ["0"])[-1]  # (imports may print before the count)
                self.compiled += int(last) if p.returncode == 0 and last.isdigit() else 0
            self.cancel()
            self.seconds = time.perf_counter() - self._start
        return self

    def cancel(self) -> None:
        """Stop the workers now (the JIT compiles what it meets itself)."""
        for p in self._procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        if self._procs:
            import shutil

            shutil.rmtree(self._dir, ignore_errors=True)
        self._procs = []


def _worker(folder: str, workers: int, index: int) -> int:
    """Worker ``index`` of ``workers``: compile the variants in ``folder``/entries.json that no other worker
    has claimed, from the ``index``-th of ``workers`` equal places in the list on -> how many it compiled."""
    data = json.loads((Path(folder) / "entries.json").read_text())
    target, entries = tuple(data["target"]), data["kernels"]
    settle_cache_keys()  # as the engine did before it launched anything: the same keys
    compiled, n = 0, len(entries)
    for j in range(n):
        i = (index * n // workers + j) % n
        try:
            os.close(os.open(Path(folder) / f"claim-{i}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            continue  # another worker has it
        compiled += compile_entry(entries[i], target)
    return compiled


_started: dict[tuple, Precompile] = {}


def start(
    gpu_name: str, target: tuple[str, int, int], root: Path = SEED_DIR, config: str | None = None
) -> Precompile:
    """``Precompile`` of the recorded variants for this GPU (none recorded: a no-op) -- ``config``'s only,
    when given --, once per process and configuration: a second engine in the process gets the first one's
    (done or under way). ``FP4MOE_PRECOMPILE=0`` turns it off."""
    key = (gpu_name, tuple(target), str(root), config)
    if key not in _started:
        off = os.environ.get("FP4MOE_PRECOMPILE", "1") == "0"
        _started[key] = Precompile([] if off else load(gpu_name, target, root, config), target)
        settle_cache_keys()  # before anything launches here, as the workers do (they are under way)
    return _started[key]


if __name__ == "__main__":  # a ``Precompile`` worker: FOLDER WORKERS INDEX
    import sys

    print(_worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
