"""Triton autotuning results recorded once per GPU and shipped, so a cold start compiles one config per
kernel instead of benchmarking every one (issue 20: a server up in about a minute).

flash-linear-attention's chunked Gated DeltaNet (the GPU prefill) autotunes about ten kernels, each over
6-30 configs, once for a single prompt and again for a step of several (varlen); on a cold Triton cache
that was 46% of the full-size warm-up's samples on the H200 (py-spy over ``benchmarks/startup.py``,
BENCHMARKS.md "Start-up time, by phase"). Triton keeps the
results on disk (``cache_results``), so a second start skips it; the first start -- every new machine,
container, or upgrade -- paid it in full.

``record`` reads the winners from the live autotuners after a warm-up (``benchmarks/startup.py
--record-autotune``); ``seed`` puts them back into a fresh process's autotuners before their first call.
A seed is used only where it can be trusted: the same GPU name, the same versions of Triton and the
library, and a config the autotuner still lists among its own (else that kernel autotunes as before).
This is fla's own config-cache idea (``FLA_CACHE_MODE``) applied to every autotuner its forward uses,
also the plain ``triton.autotune`` ones that mechanism leaves out.
"""

from __future__ import annotations

import importlib
import json
import re
import sys
from importlib import metadata
from pathlib import Path

SEED_DIR = Path(__file__).resolve().parent.parent / "data"


def gpu_file(kind: str, gpu_name: str, root: Path = SEED_DIR) -> Path:
    """A GPU's seed file of a kind: ``<kind>-<name with non-alphanumerics as _>.json``."""
    return root / f"{kind}-{re.sub(r'[^0-9A-Za-z]+', '_', gpu_name).strip('_')}.json"


def seed_path(gpu_name: str, root: Path = SEED_DIR) -> Path:
    """The autotuning seed file of a GPU: ``autotune-<name>.json``."""
    return gpu_file("autotune", gpu_name, root)


def read_seed(path: Path, kind: str) -> dict | None:
    """A seed file's content, None where there is none; a clear error where it is not JSON."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{path} is not a valid {kind} seed file ({e}); remove it or record it again"
        ) from None


def write_whole(path: Path, data: dict, indent: int = 1) -> Path:
    """``data`` as JSON at ``path``, written whole, then renamed (no half-written seed file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=indent, sort_keys=True) + "\n")
    tmp.replace(path)
    return path


def triton_version() -> str | None:
    """The installed Triton's version (None: not installed)."""
    try:
        return metadata.version("triton")
    except metadata.PackageNotFoundError:
        return None


def _versions(package: str) -> dict[str, str | None]:
    """Triton's and ``package``'s versions (its ``__version__``: fla's distribution is named fla-core)."""
    mod = sys.modules.get(package)
    return {"triton": triton_version(), package: getattr(mod, "__version__", None)}


def _autotuners(prefix: str):
    """(``module:name``, autotuner) for every Triton autotuner bound at the top level of an imported
    module whose name starts with ``prefix``, also under other decorators (``triton.heuristics`` wraps
    most of fla's: the autotuner is its ``fn``). A kernel bound in several modules is listed once, under
    the first of them by name."""
    seen = set()
    for mod_name, mod in sorted(sys.modules.items(), key=lambda m: m[0]):
        if mod is None or not (mod_name == prefix or mod_name.startswith(prefix + ".")):
            continue
        for name, obj in list(vars(mod).items()):
            obj = _unwrap(obj)
            if obj is not None and id(obj) not in seen:
                seen.add(id(obj))
                yield f"{mod_name}:{name}", obj


def _unwrap(obj):
    """The Triton autotuner ``obj`` is or wraps (decorators nest a few deep at most), else None."""
    from triton.runtime.autotuner import Autotuner

    for _ in range(4):
        if isinstance(obj, Autotuner):
            return obj
        obj = getattr(obj, "fn", None)
    return None


def _config_dict(cfg) -> dict:
    return {
        "kwargs": dict(cfg.kwargs),
        "num_warps": cfg.num_warps,
        "num_stages": cfg.num_stages,
        "num_ctas": cfg.num_ctas,
        "maxnreg": cfg.maxnreg,
    }


def record(gpu_name: str, package: str = "fla") -> dict:
    """The winning config of every key each of ``package``'s autotuners has tuned in this process, with
    the GPU and the versions they hold for."""
    kernels = {}
    for where, tuner in sorted(_autotuners(package), key=lambda t: t[0]):
        entries = [{"key": list(key), "config": _config_dict(cfg)} for key, cfg in tuner.cache.items()]
        if entries:
            kernels[where] = sorted(entries, key=lambda e: json.dumps(e["key"]))
    return {"gpu": gpu_name, "package": package, "versions": _versions(package), "kernels": kernels}


def _key(value):
    return tuple(_key(v) for v in value) if isinstance(value, list) else value


def seed(gpu_name: str, package: str = "fla", root: Path = SEED_DIR) -> int:
    """Put the recorded winners for ``gpu_name`` into ``package``'s autotuners (imported already) for the
    keys they have not tuned yet -> how many were seeded (0: no seed for this GPU, other versions, or
    nothing matched). An entry whose kernel is gone, or whose config is not one of the autotuner's own,
    is skipped: that key autotunes as it would have."""
    data = read_seed(seed_path(gpu_name, root), "autotune")
    if data is None or data.get("package") != package or data.get("versions") != _versions(package):
        return 0
    seeded = 0
    for where, entries in data.get("kernels", {}).items():
        mod_name, _, name = where.partition(":")
        try:
            tuner = getattr(importlib.import_module(mod_name), name)
        except (ImportError, AttributeError):
            continue
        tuner = _unwrap(tuner)
        if tuner is None:
            continue
        own = {json.dumps(_config_dict(c), sort_keys=True): c for c in tuner.configs}
        cache = tuner.cache
        for entry in entries:
            cfg = own.get(json.dumps(entry["config"], sort_keys=True))
            key = _key(entry["key"])
            if cfg is not None and key not in cache:
                cache[key] = cfg
                seeded += 1
    return seeded


def merge(old: dict | None, new: dict) -> dict:
    """``new``'s recorded winners over ``old``'s (a seed file of the same GPU and versions, or None): a key
    tuned in both takes ``new``'s config, every other key of either is kept. Files of another GPU or other
    versions are not mixed: ``new`` alone."""
    if not old or (old.get("gpu"), old.get("package"), old.get("versions")) != (
        new["gpu"],
        new["package"],
        new["versions"],
    ):
        return new
    kernels = {}
    for where in sorted(set(old.get("kernels", {})) | set(new["kernels"])):
        entries = {json.dumps(e["key"]): e for e in old.get("kernels", {}).get(where, [])}
        entries.update({json.dumps(e["key"]): e for e in new["kernels"].get(where, [])})
        kernels[where] = [entries[k] for k in sorted(entries)]
    return {**new, "kernels": kernels}


def write(data: dict, root: Path) -> Path:
    """``record``'s result to its seed file under ``root`` (written whole, then renamed)."""
    return write_whole(seed_path(data["gpu"], root), data)
