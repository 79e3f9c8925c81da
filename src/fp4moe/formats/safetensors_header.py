"""The one validator of safetensors headers and index files: everything the safetensors library itself
checks (structure, dtypes, shape x element size = the bytes given, offsets contiguous and covering the
file), so nothing that library would refuse reaches a reader, with a one-line message naming the tensor."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# safetensors dtype strings -> bits per element (the dtypes safetensors 0.5-0.8 accepts)
DTYPE_BITS = {
    "BOOL": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}


class HeaderError(ValueError):
    """A safetensors header or index that is malformed (the message names the file and the tensor)."""


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    start: int  # byte offsets within the data section, [start, end)
    end: int


def _is_count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _type_name(x) -> str:
    return {dict: "an object", list: "a list", str: "a string", type(None): "null"}.get(
        type(x), type(x).__name__
    )


def parse_header(raw: bytes, data_len: int, where: str) -> dict[str, TensorEntry]:
    """Validate a header's JSON bytes against a data section of ``data_len`` bytes -> entries by name."""
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as e:  # bad JSON or bad UTF-8
        raise HeaderError(f"{where}: corrupt safetensors header (not JSON: {str(e)[:100]})") from None
    if not isinstance(header, dict):
        raise HeaderError(f"{where}: corrupt safetensors header (it is {_type_name(header)}, not an object)")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise HeaderError(f"{where}: corrupt safetensors header (__metadata__ must map strings to strings)")
    entries = {name: _entry(name, v, where) for name, v in header.items()}
    end = 0
    previous = None
    for name, e in sorted(entries.items(), key=lambda kv: (kv[1].start, kv[1].end)):
        if e.start < end:
            raise HeaderError(f"{where}: tensor {name}'s data [{e.start}, {e.end}) overlaps {previous}'s")
        if e.start > end:
            raise HeaderError(f"{where}: {e.start - end} unused bytes before tensor {name}'s data")
        end, previous = e.end, name
    if end > data_len:
        raise HeaderError(f"{where}: truncated: tensors need {end} data bytes, the file has {data_len}")
    if end < data_len:
        raise HeaderError(
            f"{where}: {data_len - end} bytes after the last tensor's data (not a safetensors file)"
        )
    return entries


def _entry(name: str, v, where: str) -> TensorEntry:
    if not isinstance(v, dict):
        raise HeaderError(f"{where}: tensor {name} is {_type_name(v)}, not an object")
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in v]
    if missing:
        raise HeaderError(f"{where}: tensor {name} has no {', '.join(missing)}")
    dtype, shape, offsets = v["dtype"], v["shape"], v["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise HeaderError(f"{where}: tensor {name} has an unknown dtype {str(dtype)[:20]!r}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise HeaderError(f"{where}: tensor {name}'s shape is not a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
        raise HeaderError(f"{where}: tensor {name}'s data_offsets are not two non-negative integers")
    start, end = offsets
    if end < start:
        raise HeaderError(f"{where}: tensor {name}'s data_offsets end before they start ({start}, {end})")
    bits = DTYPE_BITS[dtype]
    for d in shape:
        bits *= d
    if bits != (end - start) * 8:
        needed = f"{bits // 8:,}" if bits % 8 == 0 else f"{bits / 8:g}"
        raise HeaderError(
            f"{where}: tensor {name} of shape {list(shape)} {dtype} needs {needed} bytes, "
            f"its data_offsets give {end - start}"
        )
    return TensorEntry(dtype, tuple(shape), start, end)


def parse_index(text: str, index: Path) -> dict[str, str]:
    """Validate an index file's text (``{"weight_map": {tensor: shard file}}``) -> the weight map; the
    shards must be plain file names in the index's folder."""
    try:
        body = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise HeaderError(f"{index}: not a valid safetensors index (not JSON: {str(e)[:100]})") from None
    if not isinstance(body, dict) or not isinstance(body.get("weight_map"), dict):
        what = _type_name(body) if not isinstance(body, dict) else "an object without a weight_map object"
        raise HeaderError(
            f'{index}: not a valid safetensors index (it is {what}; expected {{"weight_map": {{...}}}})'
        )
    weight_map = body["weight_map"]
    for name, file in weight_map.items():
        if not isinstance(file, str) or not file or Path(file).name != file:
            raise HeaderError(f"{index}: tensor {name} maps to {str(file)[:60]!r}, not a shard file name")
    return weight_map
