"""Tiny random qwen3_5_moe checkpoints (built with transformers), cached per test session."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from fp4moe.formats.checkpoint import INDEX_NAME, ShardedWriter
from fp4moe.models.tiny import CheckpointLayout, TinySpec, write_tiny_checkpoint
from fp4moe.quantize.options import QuantizeOptions
from fp4moe.quantize.pipeline import quantize

# float32 calibration so expert statistics can be compared with transformers run in float32
CALIB = dict(num_samples=8, seq_len=64, progress=False, calib_dtype="float32")


class Checkpoints:
    """Builds each checkpoint once: ``bf16(layout)``, ``quantized(layout, fmt)``."""

    def __init__(self, root: Path):
        self.root = root
        self._cache: dict[tuple, Path] = {}

    def bf16(self, layout: CheckpointLayout = CheckpointLayout.QWEN3_5, spec: TinySpec | None = None) -> Path:
        key = ("bf16", layout, repr(spec))
        if key not in self._cache:
            self._cache[key] = write_tiny_checkpoint(
                self.root / f"bf16-{layout.value}-{len(self._cache)}", layout, spec
            )
        return self._cache[key]

    def quantized(
        self, layout: CheckpointLayout = CheckpointLayout.QWEN3_5, fmt: str = "modelopt", **options
    ) -> Path:
        key = ("q", layout, fmt, tuple(sorted(options.items())))
        if key not in self._cache:
            dst = self.root / f"q-{layout.value}-{fmt}-{len(self._cache)}"
            quantize(self.bf16(layout), dst, QuantizeOptions(format=fmt, **{**CALIB, **options}))
            self._cache[key] = dst
        return self._cache[key]

    def copy(self, src: Path, name: str) -> Path:
        dst = self.root / f"copy-{name}-{len(self._cache)}"
        self._cache[("copy", name, len(self._cache))] = dst
        shutil.copytree(src, dst)
        return dst


def load_all(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory."""
    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def rewrite_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Replace a checkpoint's shards and index with ``tensors`` (test helper for planting defects)."""
    for f in Path(path).glob("*.safetensors"):
        f.unlink()
    (Path(path) / INDEX_NAME).unlink(missing_ok=True)
    writer = ShardedWriter(Path(path), max_shard_bytes=200_000)
    for name in sorted(tensors):
        writer.add(name, tensors[name])
    writer.close()


def no_eos(model) -> None:
    """Let transformers' greedy decoding run through EOS like our ``ignore_eos`` (``min_new_tokens`` would
    instead forbid EOS, which changes the argmax whenever EOS is the best token)."""
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0


class FuzzReport(UserWarning):
    """What a fuzz run sent and got back (tests/server/test_fuzz.py), shown in pytest's warnings summary. It
    lives here because pytest-xdist's controller re-imports a warning's class by module name, and only the
    tests folder is on the import path (``tests/server/test_fuzz`` is not a module it can import)."""


def load_script(relative: str):
    """A script of the repository (``scripts/...``, ``benchmarks/...``) imported as a module, for its tests."""
    path = Path(__file__).resolve().parents[1] / relative
    if str(path.parent) not in sys.path:  # as running it does: its folder's modules importable
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # as an import does (dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


# transformers' Gated DeltaNet functions, which it swaps for flash-linear-attention's where fla imports
_TRANSFORMERS_GDN = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                     "causal_conv1d_update")  # fmt: skip


def transformers_reference(path: Path, dtype: torch.dtype = torch.float32):
    """transformers' Qwen3_5MoeForConditionalGeneration from ``path`` on the CPU, in eval mode, on its own torch
    Gated DeltaNet. Where fla is installed (the GPU machine's carried wheels) transformers binds fla's kernels at
    import, CUDA-only, and its CPU forward fails ("cannot be accessed from Triton (cpu tensor?)"); fla in fp32
    would multiply in TF32 too. The torch functions are the wrappers' ``__wrapped__``."""
    import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe as modeling
    from transformers import Qwen3_5MoeForConditionalGeneration

    for name in _TRANSFORMERS_GDN:
        fn = getattr(modeling, name, None)
        while fn is not None and hasattr(fn, "__wrapped__"):
            fn = fn.__wrapped__
        if fn is not None:
            setattr(modeling, name, fn)
    return Qwen3_5MoeForConditionalGeneration.from_pretrained(str(path), dtype=dtype).eval()
