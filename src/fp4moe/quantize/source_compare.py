"""An inspected checkpoint against its bf16 source: every tensor kept under its name, dtype and shape must be
byte-identical to the source's (``compare_with_source``), compared a chunk at a time so memory stays bounded
(``byte_differences``). Part of ``quantize.inspect``."""

from __future__ import annotations

import math

import torch

from fp4moe.formats.checkpoint import CheckpointReader
from fp4moe.models import qwen3_5_moe as arch

COMPARE_CHUNK_BYTES = 16 << 20  # bytes of one tensor held from each checkpoint while comparing


def byte_differences(reader: CheckpointReader, reference: CheckpointReader, name: str) -> str | None:
    """How ``name`` (same dtype and shape in both) differs byte-wise from the source, or None if identical.
    Reads the raw bytes a chunk at a time, so memory stays bounded whatever the tensor's size."""
    a, b = reference.info(name), reader.info(name)
    if a.length != b.length:
        return f"{a.length} bytes in the source, {b.length} here"
    if a.length == 0:
        return None
    numel = math.prod(a.shape)
    item = a.length // numel if numel and a.length % numel == 0 else 1  # sub-byte dtypes: count bytes
    unit = "elements" if item > 1 or numel == a.length else "bytes"
    chunk = max(COMPARE_CHUNK_BYTES // item, 1) * item  # whole elements per chunk
    size = min(chunk, a.length)
    buf_a, buf_b = bytearray(size), bytearray(size)
    ta, tb = torch.frombuffer(buf_a, dtype=torch.uint8), torch.frombuffer(buf_b, dtype=torch.uint8)
    bytes_differ = units_differ = 0
    first = None
    with open(reference.path / a.file, "rb") as fa, open(reader.path / b.file, "rb") as fb:
        fa.seek(a.offset)
        fb.seek(b.offset)
        for start in range(0, a.length, chunk):
            n = min(chunk, a.length - start)
            if fa.readinto(memoryview(buf_a)[:n]) != n or fb.readinto(memoryview(buf_b)[:n]) != n:
                return f"truncated at byte {start} of its {a.length}"
            if torch.equal(ta[:n], tb[:n]):
                continue
            diff = ta[:n] != tb[:n]
            bytes_differ += int(diff.sum())
            per_unit = diff.view(-1, item).any(dim=1)
            units_differ += int(per_unit.sum())
            if first is None:
                first = start // item + int(per_unit.nonzero()[0, 0])
    if not bytes_differ:
        return None
    total = numel if unit == "elements" else a.length
    return (
        f"{units_differ} of {total} {unit} differ from the source ({bytes_differ} differing bytes, "
        f"the first at flat index {first})"
    )


def compare_with_source(reader: CheckpointReader, reference: CheckpointReader, problems) -> None:
    """Everything but the routed experts of the decoder layers and the linears quantized on purpose
    (``--quantize``: NVFP4 codes, FP8 weights or compressed-tensors ``weight_packed`` in their place) must be
    carried over unchanged: same name, shape and dtype, and byte for byte the same values. That covers
    norms, routers, embeddings, lm_head, linears kept in bf16, the vision tower and every MTP tensor (MTP
    experts included: the quantizer copies ``mtp.*`` verbatim, whatever its layout). ``problems``: the
    inspection's tally (``problems.add(kind, message)``)."""
    for name in reference.names():
        if arch.classify(name) is arch.Role.ROUTED_EXPERT and not name.startswith("mtp."):
            continue  # quantized, and renamed where the source fuses them; checked above
        a = reference.info(name)
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and len(a.shape) == 2 and f"{module}.weight_packed" in reader:
            continue  # quantized on purpose (compressed-tensors names); its tensors are checked above
        if name not in reader:
            problems.add("lost", f"{name} from the source checkpoint is missing")
            continue
        b = reader.info(name)
        if b.dtype == "U8" and len(a.shape) == 2 and tuple(b.shape) == (a.shape[0], a.shape[1] // 2):
            continue  # quantized on purpose (--quantize): NVFP4 codes of this linear
        if b.dtype == "F8_E4M3" and len(a.shape) == 2 and tuple(b.shape) == tuple(a.shape):
            continue  # quantized on purpose (--quantize GROUP:fp8)
        if (a.dtype, a.shape) != (b.dtype, b.shape):
            problems.add(
                "changed", f"{name}: {a.dtype}{list(a.shape)} in the source, {b.dtype}{list(b.shape)} here"
            )
            continue
        difference = byte_differences(reader, reference, name)
        if difference is not None:
            problems.add("changed-values", f"{name} is not quantized, but {difference}")
