"""The safetensors header and index validator: each malformed case is refused in one line by the reader
(and so by ``inspect``, ``quantize``, ``convert`` and ``serve``) exactly where the safetensors library
refuses it too, and what that library accepts reads."""

import json
import re
import struct
import subprocess
import sys

import pytest
from safetensors import SafetensorError, safe_open

from fp4moe.cli import main
from fp4moe.formats.checkpoint import INDEX_NAME, CheckpointError, read_header


def _entry(dtype="F32", shape=(2,), offsets=(0, 8)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


def _write(path, header, data: bytes):
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def _safetensors_refuses(path) -> bool:
    try:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                f.get_slice(name)
    except SafetensorError:
        return True
    return False


MALFORMED = [
    ("a JSON list", [1, 2], b"", "it is a list, not an object"),
    ("a tensor that is a string", {"a": "x"}, b"", "tensor a is a string"),
    ("no data_offsets", {"a": {"dtype": "F32", "shape": [2]}}, b"\0" * 8, "tensor a has no data_offsets"),
    ("no dtype", {"a": {"shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, "has no dtype"),
    ("an unknown dtype", {"a": _entry("F128")}, b"\0" * 8, "unknown dtype 'F128'"),
    ("a negative dimension", {"a": _entry(shape=(-2,))}, b"\0" * 8, "not a list of non-negative"),
    ("offsets reversed", {"a": _entry(offsets=(8, 0))}, b"\0" * 8, "end before they start"),
    ("three offsets", {"a": _entry(offsets=(0, 4, 8))}, b"\0" * 8, "not two non-negative integers"),
    ("a huge shape over little data", {"a": _entry(shape=(10**6, 10**6))}, b"\0" * 8, "needs 4,000,000,000,000 bytes"),
    ("overlapping data", {"a": _entry(), "b": _entry(shape=(1,), offsets=(4, 8))}, b"\0" * 8, "overlaps a"),
    ("a hole in the data", {"a": _entry(shape=(1,), offsets=(4, 8))}, b"\0" * 8, "4 unused bytes before"),
    ("offsets past the file", {"a": _entry(shape=(4,), offsets=(0, 16))}, b"\0" * 8, "truncated"),
    ("bytes after the data", {"a": _entry()}, b"\0" * 12, "4 bytes after the last tensor"),
    ("metadata not strings", {"__metadata__": {"k": 1}, "a": _entry()}, b"\0" * 8, "__metadata__"),
    ("an odd count of 4-bit values", {"a": _entry("F4", (3,), (0, 2))}, b"\0" * 2, "needs 1.5 bytes"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "header", "data", "message"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_header_is_one_line_and_safetensors_refuses_it_too(tmp_path, case, header, data, message):
    path = _write(tmp_path / "x.safetensors", header, data)
    with pytest.raises(CheckpointError, match=re.escape(message)) as e:
        read_header(path)
    assert "\n" not in str(e.value) and str(path) in str(e.value)
    assert _safetensors_refuses(path), f"{case}: safetensors reads it, so should we"


@pytest.mark.parametrize(
    ("header", "data"),
    [
        ({"a": _entry(), "__metadata__": {"format": "pt"}}, b"\0" * 8),
        ({"a": {**_entry(), "extra": 1}}, b"\0" * 8),
        ({"b": _entry(offsets=(8, 16)), "a": _entry()}, b"\0" * 16),  # out of order in the header
        ({"a": _entry("F4", (4,), (0, 2)), "e": _entry(shape=(0, 3), offsets=(2, 2))}, b"\0" * 2),
        ({}, b""),
    ],
)
def test_what_safetensors_reads_is_read(tmp_path, header, data):
    path = _write(tmp_path / "x.safetensors", header, data)
    assert not _safetensors_refuses(path)
    infos = read_header(path)
    assert set(infos) == set(header) - {"__metadata__"}


def _header(shard):
    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _edit_header(path, edit):
    """Rewrite the header of the shard with the most tensors with ``edit(header)``, its data unchanged."""
    shard = max(sorted(path.glob("*.safetensors")), key=lambda f: len(_header(f)[0]))
    header, data = _header(shard)
    header = edit(header) or header
    _write(shard, header, data)


def _first_tensor(h):
    return next(k for k in h if k != "__metadata__")


def _huge_shape(h):
    h[_first_tensor(h)]["shape"] = [10**6, 10**6]


def _no_offsets(h):
    del h[_first_tensor(h)]["data_offsets"]


def _unknown_dtype(h):
    h[_first_tensor(h)]["dtype"] = "Q4"


def _overlap(h):
    names = sorted((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"])
    a, b = h[names[0]], h[names[1]]
    b["data_offsets"] = [
        a["data_offsets"][0],
        a["data_offsets"][0] + b["data_offsets"][1] - b["data_offsets"][0],
    ]


CLI_CASES = {
    "huge shape": (lambda p: _edit_header(p, _huge_shape), "bytes, its data_offsets give"),
    "header a list": (lambda p: _edit_header(p, lambda h: [h]), "it is a list, not an object"),
    "no data_offsets": (lambda p: _edit_header(p, _no_offsets), "has no data_offsets"),
    "unknown dtype": (lambda p: _edit_header(p, _unknown_dtype), "unknown dtype 'Q4'"),
    "overlapping offsets": (lambda p: _edit_header(p, _overlap), "overlaps"),
    "index a list": (lambda p: (p / INDEX_NAME).write_text("[]"), "not a valid safetensors index"),
    "index shard a number": (
        lambda p: (p / INDEX_NAME).write_text(json.dumps({"weight_map": {"x": 3}})),
        "not a shard file name",
    ),
    "index shard outside": (
        lambda p: (p / INDEX_NAME).write_text(json.dumps({"weight_map": {"x": "../model.safetensors"}})),
        "not a shard file name",
    ),
}


@pytest.fixture(scope="module")
def sources(checkpoints):
    return {"bf16": checkpoints.bf16(), "quantized": checkpoints.quantized()}


@pytest.mark.parametrize("case", list(CLI_CASES))
def test_inspect_quantize_convert_refuse_in_one_line_with_exit_2(
    checkpoints, sources, tmp_path, capsys, case
):
    plant, message = CLI_CASES[case]
    commands = {
        "inspect": ("quantized", lambda p: ["inspect", str(p)]),
        "quantize": ("bf16", lambda p: ["quantize", str(p), str(tmp_path / "q"), "--no-progress"]),
        "convert": ("quantized", lambda p: ["convert", str(p), str(tmp_path / "c"), "--no-progress"]),
    }
    for command, (source, argv) in commands.items():
        path = checkpoints.copy(sources[source], f"{command}-{case}".replace(" ", "-"))
        plant(path)
        capsys.readouterr()
        assert main(argv(path)) == 2, command
        out, err = capsys.readouterr()
        assert "OK" not in out
        assert err.count("\n") == 1 and err.startswith(f"fp4moe {command}: error: ") and message in err, err


def test_serve_refuses_a_malformed_checkpoint_in_one_line(checkpoints, sources):
    path = checkpoints.copy(sources["bf16"], "serve-huge-shape")
    _edit_header(path, _huge_shape)
    cmd = [sys.executable, "-m", "fp4moe.cli", "serve", str(path), "--device", "cpu", "--dtype", "float32"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("fp4moe serve: error: ")
    assert "its data_offsets give" in proc.stderr
