"""safetensors checkpoint directories: a lazy, validated reader and a streaming, atomic writer."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from fp4moe.errors import UserError
from fp4moe.formats.safetensors_header import HeaderError, parse_header, parse_index

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

TORCH_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "U8": torch.uint8,
    "I64": torch.int64,
    "I32": torch.int32,
}


class CheckpointError(UserError, ValueError):
    """A checkpoint directory that cannot be read as it claims to be."""


# a Hugging Face hub id (``Qwen/Qwen3.6-35B-A3B``): what a user may pass where a local directory is needed
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def not_a_checkpoint(path: str | os.PathLike, what: str = "no config.json") -> str:
    """The one-line message for a path that is not a checkpoint directory: a missing path says so, and one
    shaped like a hub id says how to download it (fp4moe reads local directories only)."""
    if Path(path).exists():
        return f"{path}: {what}"
    hint = ""
    if HUB_ID.match(str(path)):
        hint = (
            f"; it looks like a Hugging Face id: fp4moe reads local directories, so download it first "
            f"(hf download {path} --local-dir DIR) and pass DIR"
        )
    return f"{path}: no such directory{hint}"


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: str
    dtype: str  # safetensors dtype string, e.g. "BF16"
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in the file
    length: int

    @property
    def torch_dtype(self) -> torch.dtype | None:
        return TORCH_DTYPES.get(self.dtype)

    @property
    def num_bytes(self) -> int:
        return self.length  # the header validator checked it is shape x element size


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and validate one safetensors file's header (see ``safetensors_header``): the file holds
    exactly the bytes its tensors promise."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        (header_len,) = struct.unpack("<Q", raw)
        if header_len > size - 8 or header_len > 100_000_000:
            raise CheckpointError(
                f"{path}: truncated or corrupt safetensors header (claims {header_len} bytes)"
            )
        raw = f.read(header_len)
    try:
        entries = parse_header(raw, size - 8 - header_len, str(path))
    except HeaderError as e:
        raise CheckpointError(str(e)) from None
    base = 8 + header_len
    return {
        name: TensorInfo(name, path.name, e.dtype, e.shape, offset=base + e.start, length=e.end - e.start)
        for name, e in entries.items()
    }


class CheckpointReader:
    """Tensors of a safetensors directory by name, read on demand (nothing is loaded up front)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(not_a_checkpoint(self.path, "not a directory"))
        self.infos: dict[str, TensorInfo] = {}
        index = self.path / INDEX_NAME
        if index.exists():
            self._read_index(index)
        else:
            files = sorted(self.path.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{self.path}: no *.safetensors files and no {INDEX_NAME}")
            for file in files:
                self._add_file(file)

    def _add_file(self, file: Path) -> dict[str, TensorInfo]:
        infos = read_header(file)
        for name, info in infos.items():
            if name in self.infos:
                raise CheckpointError(
                    f"{self.path}: tensor {name} is in both {self.infos[name].file} and {file.name}"
                )
            self.infos[name] = info
        return infos

    def _read_index(self, index: Path) -> None:
        try:
            weight_map = parse_index(index.read_text(errors="replace"), index)
        except HeaderError as e:
            raise CheckpointError(str(e)) from None
        for file in sorted(set(weight_map.values())):
            if not (self.path / file).exists():
                names = [n for n, f in weight_map.items() if f == file]
                raise CheckpointError(
                    f"{self.path}: shard {file} is missing (it should hold {len(names)} tensors, e.g. {names[0]})"
                )
            self._add_file(self.path / file)
        for name, file in weight_map.items():
            info = self.infos.get(name)
            if info is None:
                raise CheckpointError(
                    f"{index}: names tensor {name} in {file}, but {file} has no such tensor"
                )
            if info.file != file:
                raise CheckpointError(f"{index}: names {name} in {file}, but it is in {info.file}")
        # tensors present in shards but absent from the index are read too (index wins on conflicts)

    def __contains__(self, name: str) -> bool:
        return name in self.infos

    def __len__(self) -> int:
        return len(self.infos)

    def names(self) -> list[str]:
        return list(self.infos)

    def info(self, name: str) -> TensorInfo:
        try:
            return self.infos[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: no tensor named {name}") from None

    def get(self, name: str) -> torch.Tensor:
        """Read one tensor into fresh memory (a plain read, no memory map: pages of tensors already
        processed do not stay resident, so host RSS tracks what the caller holds)."""
        info = self.info(name)
        dtype = TORCH_DTYPES.get(info.dtype)
        if dtype is None:  # rare dtypes: let safetensors decode them
            with safe_open(str(self.path / info.file), framework="pt") as f:
                return f.get_tensor(name)
        buf = bytearray(info.length)
        with open(self.path / info.file, "rb") as f:
            f.seek(info.offset)
            if f.readinto(buf) != info.length:
                raise CheckpointError(f"{self.path / info.file}: truncated while reading {name}")
        if info.length == 0:
            return torch.empty(info.shape, dtype=dtype)
        return torch.frombuffer(buf, dtype=dtype).reshape(info.shape)

    def total_bytes(self) -> int:
        return sum(i.num_bytes for i in self.infos.values())


def parse_size(text: str | int) -> int:
    """'5GB' / '500MB' / '1024' -> bytes."""
    if isinstance(text, int):
        return text
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except ValueError:
        raise ValueError(f"invalid size {text!r}; use e.g. 2GB, 500MB or a byte count") from None


class ShardedWriter:
    """Writes tensors into ``model-XXXXX-of-YYYYY.safetensors`` shards of at most ``max_shard_bytes``
    (one tensor larger than that gets a shard of its own) plus an index. Holds at most one shard."""

    def __init__(self, out_dir: Path, max_shard_bytes: int = 2 << 30, metadata: dict[str, str] | None = None):
        self.out_dir = Path(out_dir)
        self.max_shard_bytes = max_shard_bytes
        self.metadata = metadata or {"format": "pt"}
        self._buffer: dict[str, torch.Tensor] = {}
        self._buffer_bytes = 0
        self._shards: list[list[str]] = []
        self._named_files: dict[str, list[str]] = {}
        self.total_bytes = 0
        self.on_flush = None  # called with the shard index after each shard is on disk (progress bars)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        num_bytes = tensor.numel() * tensor.element_size()
        if self._buffer and self._buffer_bytes + num_bytes > self.max_shard_bytes:
            self.flush()
        self._buffer[name] = tensor.detach().to("cpu").contiguous()
        self._buffer_bytes += num_bytes
        self.total_bytes += num_bytes

    def flush(self) -> None:
        if not self._buffer:
            return
        index = len(self._shards)
        _save(self._buffer, self.out_dir / f".shard-{index:05d}.safetensors", self.metadata)
        self._shards.append(list(self._buffer))
        self._buffer, self._buffer_bytes = {}, 0
        if self.on_flush is not None:
            self.on_flush(index)

    def write_file(self, filename: str, tensors: dict[str, torch.Tensor]) -> None:
        """A named extra shard (e.g. ``model-mtp.safetensors``), listed in the index too."""
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
        _save(tensors, self.out_dir / filename, self.metadata)
        self._named_files[filename] = list(tensors)
        self.total_bytes += sum(t.numel() * t.element_size() for t in tensors.values())

    def close(self) -> dict[str, str]:
        """Flush, give the shards their final names, write the index; returns the weight map."""
        self.flush()
        weight_map: dict[str, str] = {}
        n = len(self._shards)
        for i, names in enumerate(self._shards):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.out_dir / f".shard-{i:05d}.safetensors", self.out_dir / final)
            weight_map.update(dict.fromkeys(names, final))
        for filename, names in self._named_files.items():
            weight_map.update(dict.fromkeys(names, filename))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        write_json(self.out_dir / INDEX_NAME, index)
        return weight_map


def _save(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    try:
        save_file(tensors, str(path), metadata=metadata)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise OSError(errno.ENOSPC, f"disk full while writing {path.name} in {path.parent}") from e
        raise
    except SafetensorError as e:  # safetensors reports I/O failures as its own error type
        if "os error 28" in str(e) or "No space left" in str(e):
            raise OSError(errno.ENOSPC, f"disk full while writing {path.name} in {path.parent}") from e
        raise OSError(f"could not write {path}: {e}") from e


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def check_destination(dst: str | os.PathLike, overwrite: bool = False) -> None:
    """Refuse, before any work, a destination that cannot be written: its folder missing, not a folder or
    not writable (read-only, no permission), or DST present without ``overwrite``."""
    dst = Path(dst).absolute()
    parent = dst.parent
    if not parent.exists():
        raise CheckpointError(f"the destination's folder {parent} does not exist; create it first")
    if not parent.is_dir():
        raise CheckpointError(f"the destination's folder {parent} is not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise CheckpointError(
            f"cannot write in {parent} (read-only or no permission); choose another destination"
        )
    if dst.exists() and not overwrite:
        raise FileExistsError(f"{dst} already exists; pass --overwrite to replace it")
    if dst.is_dir() and not os.access(dst, os.W_OK | os.X_OK):
        raise CheckpointError(
            f"cannot replace {dst} (read-only or no permission); choose another destination"
        )


@contextlib.contextmanager
def atomic_output_dir(dst: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary directory beside ``dst``; on success it replaces ``dst`` in one rename.

    On any error (or a kill) ``dst`` is untouched: it does not exist or is the old one. With
    ``overwrite`` an existing ``dst`` is moved aside, replaced, and only then deleted.
    """
    dst = Path(dst).resolve()
    if dst.exists() and not overwrite:
        raise FileExistsError(f"{dst} already exists; pass --overwrite to replace it")
    dst.parent.mkdir(parents=True, exist_ok=True)
    recover_interrupted_output(dst)
    tmp = dst.parent / f".{dst.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if dst.exists():
        old = dst.parent / f".{dst.name}.old-{os.getpid()}"
        os.replace(dst, old)
    os.replace(tmp, dst)
    if old is not None:
        _remove(old)


def _remove(path: Path) -> None:
    """Delete a folder or a file (--overwrite may replace either)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def recover_interrupted_output(dst: Path) -> None:
    """Leftovers of earlier runs that were killed (their process is gone): temp dirs are deleted; an old
    DST moved aside by a run killed between its two renames is put back when DST is absent."""
    pattern = re.compile(rf"^\.{re.escape(dst.name)}\.(tmp|old)-(\d+)$")
    for p in dst.parent.iterdir():
        m = pattern.match(p.name)
        if m is None or int(m[2]) == os.getpid() or _pid_alive(int(m[2])):
            continue
        if m[1] == "old" and not dst.exists():
            os.replace(p, dst)
        else:
            _remove(p)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def copy_side_files(src: Path, dst: Path, skip: set[str]) -> list[str]:
    """Copy every non-weight file (tokenizer, chat template, processor, generation config...)."""
    copied = []
    for p in sorted(Path(src).iterdir()):
        if p.name in skip or p.suffix == ".safetensors" or p.name.startswith("."):
            continue
        if p.suffix in (".bin", ".pt", ".pth", ".pkl", ".ckpt"):
            continue  # pickled weights are never read or propagated
        if p.is_dir():
            shutil.copytree(p, dst / p.name)
        else:
            shutil.copy2(p, dst / p.name)
        copied.append(p.name)
    return copied
