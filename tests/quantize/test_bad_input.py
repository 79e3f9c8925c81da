"""Bad input gets a clear error and nothing is half-written: DST absent (or the old one), no temp dir left."""

import dataclasses
import errno
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from fixtures import load_all, rewrite_tensors
from fp4moe.cli import main
from fp4moe.data.windows import WindowError
from fp4moe.formats.checkpoint import INDEX_NAME, CheckpointError
from fp4moe.formats.nvfp4 import NVFP4Error
from fp4moe.models.qwen3_5_moe import UnsupportedModelError
from fp4moe.models.tiny import CheckpointLayout, TinySpec
from fp4moe.quantize.calib_data import CalibrationDataError
from fp4moe.quantize.options import QuantizeError, QuantizeOptions
from fp4moe.quantize.pipeline import quantize

FAST = QuantizeOptions(num_samples=2, seq_len=32, progress=False)


def _nothing_written(dst):
    assert not dst.exists()
    leftovers = [p.name for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}.")]
    assert leftovers == [], leftovers


@pytest.fixture
def src(checkpoints):
    return checkpoints.copy(checkpoints.bf16(), "bad")


def test_missing_shard(src, tmp_path):
    next(src.glob("model-00003-*.safetensors")).unlink()
    with pytest.raises(CheckpointError, match=r"shard model-00003-of-\d+\.safetensors is missing"):
        quantize(src, tmp_path / "out", FAST)
    _nothing_written(tmp_path / "out")


def test_truncated_shard(src, tmp_path):
    shard = next(src.glob("model-00002-*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="truncated"):
        quantize(src, tmp_path / "out", FAST)
    _nothing_written(tmp_path / "out")


def test_index_names_absent_tensor(src, tmp_path):
    index = json.loads((src / INDEX_NAME).read_text())
    shard = next(iter(index["weight_map"].values()))
    index["weight_map"]["model.language_model.layers.0.mlp.ghost.weight"] = shard
    (src / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(
        CheckpointError, match=f"names tensor model.language_model.layers.0.mlp.ghost.weight in {shard}"
    ):
        quantize(src, tmp_path / "out", FAST)
    _nothing_written(tmp_path / "out")


def test_unsupported_model_type(src, tmp_path):
    cfg = json.loads((src / "config.json").read_text())
    cfg["model_type"] = "llama"
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="unsupported model_type 'llama'"):
        quantize(src, tmp_path / "out", FAST)
    _nothing_written(tmp_path / "out")


def test_dimension_not_divisible_by_group_size(checkpoints, tmp_path):
    src = checkpoints.bf16(
        CheckpointLayout.QWEN3_5, TinySpec(moe_intermediate_size=24, shared_expert_intermediate_size=24)
    )
    with pytest.raises(
        NVFP4Error, match="moe_intermediate_size 24 is not divisible by the NVFP4 group size 16"
    ):
        quantize(src, tmp_path / "out", FAST)
    _nothing_written(tmp_path / "out")


@pytest.mark.parametrize(
    "where", ["model.language_model.layers.2.mlp.experts.gate_up_proj", "model.language_model.norm.weight"]
)
def test_nan_weights(src, tmp_path, where):
    tensors = load_all(src)
    t = tensors[where].clone()
    t.view(-1)[5] = float("nan")
    tensors[where] = t
    rewrite_tensors(src, tensors)
    with pytest.raises(NVFP4Error, match="NaN"):
        quantize(src, tmp_path / "out", FAST)
    _nothing_written(tmp_path / "out")


def test_dst_exists_is_kept_without_overwrite(checkpoints, tmp_path):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "precious.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="--overwrite"):
        quantize(checkpoints.bf16(), dst, FAST)
    assert (dst / "precious.txt").read_text() == "keep me"


def test_overwrite_replaces_only_when_complete(checkpoints, tmp_path):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "old.txt").write_text("old")
    quantize(
        checkpoints.bf16(), dst, QuantizeOptions(num_samples=2, seq_len=32, progress=False, overwrite=True)
    )
    assert not (dst / "old.txt").exists() and (dst / "config.json").exists()


def test_disk_full_leaves_nothing(checkpoints, tmp_path, monkeypatch):
    import fp4moe.formats.checkpoint as ckpt

    calls = {"n": 0}
    real = ckpt.save_file

    def full_disk(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            real(*args, **kwargs)  # the first shard fits ...
            return
        raise OSError(errno.ENOSPC, "No space left on device")  # ... the second does not

    monkeypatch.setattr(ckpt, "save_file", full_disk)
    dst = tmp_path / "out"
    with pytest.raises(OSError, match="disk full while writing"):
        quantize(
            checkpoints.bf16(),
            dst,
            QuantizeOptions(num_samples=2, seq_len=32, progress=False, max_shard_size=100_000),
        )
    _nothing_written(dst)


def test_bad_calibration_inputs(checkpoints, tmp_path):
    bad = tmp_path / "calib.jsonl"
    bad.write_text('{"text": "fine"}\n{"txt": 1}\n')
    with pytest.raises(CalibrationDataError, match=r'calib.jsonl:2: expected an object with a "text" string'):
        quantize(checkpoints.bf16(), tmp_path / "out", QuantizeOptions(calib_file=str(bad), progress=False))
    short = tmp_path / "short.txt"
    short.write_text("too short")
    with pytest.raises(WindowError, match="fewer than --seq-len"):
        quantize(
            checkpoints.bf16(),
            tmp_path / "out",
            QuantizeOptions(calib_file=str(short), seq_len=64, progress=False),
        )
    with pytest.raises(ValueError, match="num_samples must be a positive integer"):
        QuantizeOptions(num_samples=0)
    _nothing_written(tmp_path / "out")


def test_calibration_file_is_used(checkpoints, tmp_path):
    text = tmp_path / "calib.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 200)
    report = quantize(
        checkpoints.bf16(),
        tmp_path / "out",
        QuantizeOptions(calib_file=str(text), num_samples=4, seq_len=32, progress=False),
    )
    assert report.calibration == f"file {text}" and report.calibration_tokens == 128


def test_cli_reports_errors_in_one_line(src, tmp_path, capsys):
    next(src.glob("model-00001-*.safetensors")).unlink()
    code = main(["quantize", str(src), str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "error:" in err and "missing" in err and "Traceback" not in err
    _nothing_written(tmp_path / "out")


def _wait_for(predicate, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


@pytest.mark.parametrize("with_old", [False, True])
def test_killed_run_leaves_dst_absent_or_old(checkpoints, tmp_path, with_old):
    dst = tmp_path / "out"
    if with_old:
        dst.mkdir()
        (dst / "old.txt").write_text("old")
    # many calibration samples so the run is still writing when it is killed
    cmd = [
        sys.executable,
        "-m",
        "fp4moe.cli",
        "quantize",
        str(checkpoints.bf16()),
        str(dst),
        "--no-progress",
        "--num-samples",
        "256",
        "--seq-len",
        "128",
        "--batch-size",
        "256",
    ]
    if with_old:
        cmd.append("--overwrite")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert _wait_for(lambda: any(p.name.startswith(".out.tmp-") for p in tmp_path.iterdir()), 120), (
            "run never started writing"
        )
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        proc.kill()
    if with_old:
        assert sorted(p.name for p in dst.iterdir()) == ["old.txt"]
    else:
        assert not dst.exists()
    # the next run cleans the dead run's temp dir up and completes
    quantize(
        checkpoints.bf16(), dst, QuantizeOptions(num_samples=2, seq_len=32, progress=False, overwrite=True)
    )
    _nothing_written(tmp_path / "other")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_nan_check_names_the_tensor():
    from fp4moe.formats import nvfp4

    w = torch.zeros(2, 16)
    w[1, 3] = float("inf")
    with pytest.raises(
        NVFP4Error, match=r"layers.7.mlp.experts: 0 NaN and 1 Inf values \(first at index \(1, 3\)\)"
    ):
        nvfp4.quantize(w, name="layers.7.mlp.experts")


def test_real_disk_full_on_a_small_tmpfs(checkpoints, tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=400k", "tmpfs", str(mnt)], capture_output=True
    ).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        with pytest.raises(OSError, match="disk full while writing"):
            quantize(
                checkpoints.bf16(), mnt / "out", QuantizeOptions(num_samples=2, seq_len=32, progress=False)
            )
        assert list(mnt.iterdir()) == []
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_safetensors_io_error_is_reported_as_disk_full(checkpoints, tmp_path, monkeypatch):
    from safetensors import SafetensorError

    import fp4moe.formats.checkpoint as ckpt

    def fail(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(ckpt, "save_file", fail)
    with pytest.raises(OSError, match="disk full while writing"):
        quantize(checkpoints.bf16(), tmp_path / "out", FAST)
    _nothing_written(tmp_path / "out")


def test_missing_tokenizer(src, tmp_path):
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (src / f).unlink(missing_ok=True)
    with pytest.raises(QuantizeError, match="no tokenizer files"):
        quantize(src, tmp_path / "out", FAST)
    _nothing_written(tmp_path / "out")


def test_missing_layer_tensor(src, tmp_path):
    tensors = load_all(src)
    del tensors["model.language_model.layers.3.self_attn.k_proj.weight"]
    rewrite_tensors(src, tensors)
    with pytest.raises(
        CheckpointError,
        match=r"decoder layer 3 \(full_attention\): missing tensors \['self_attn.k_proj.weight'\]",
    ):
        quantize(src, tmp_path / "out", FAST)
    _nothing_written(tmp_path / "out")


def test_old_dst_moved_aside_by_a_killed_run_is_restored(checkpoints, tmp_path):
    dead = tmp_path / ".out.old-999999999"
    dead.mkdir()
    (dead / "old.txt").write_text("old")
    with pytest.raises(FileExistsError):
        quantize(checkpoints.bf16(), tmp_path / "out", FAST)
    assert (tmp_path / "out" / "old.txt").read_text() == "old" and not dead.exists()


def test_resave_without_mtp_tensors_quantizes_with_a_warning(checkpoints, tmp_path):
    import json

    from fp4moe.quantize.inspect import inspect_checkpoint

    src = checkpoints.copy(checkpoints.bf16(CheckpointLayout.RESAVED), "no-mtp")
    tensors = {k: v for k, v in load_all(src).items() if not k.startswith("mtp.")}
    rewrite_tensors(src, tensors)  # what transformers' save_pretrained writes: MTP dropped, config key kept
    report = quantize(src, tmp_path / "out", FAST)
    assert any("no mtp.* tensors" in w for w in report.warnings)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["text_config"]["mtp_num_hidden_layers"] == 0
    assert inspect_checkpoint(tmp_path / "out").ok


def _set_text_config(path, **values):
    cfg = json.loads((path / "config.json").read_text())
    cfg["text_config"].update(values)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("num_experts a string", "num_experts must be a positive integer, got '8'"),
        ("top-k past the experts", "num_experts_per_tok (9) exceeds num_experts (8)"),
        ("parent missing", "does not exist; create it first"),
        ("parent a file", "is not a folder"),
        ("parent read-only", "read-only or no permission"),
        ("dst read-only", "cannot replace"),
    ],
)
def test_bad_config_or_destination_is_one_line_exit_2(src, tmp_path, capsys, monkeypatch, case, message):
    dst = tmp_path / "out"
    if case == "num_experts a string":
        _set_text_config(src, num_experts="8")
    elif case == "top-k past the experts":
        _set_text_config(src, num_experts_per_tok=9)
    elif case == "parent missing":
        dst = tmp_path / "absent" / "out"
    elif case == "parent a file":
        (tmp_path / "file").write_text("x")
        dst = tmp_path / "file" / "out"
    else:  # tests run as root, whom chmod does not stop: the permission check is what is exercised
        blocked = tmp_path if case == "parent read-only" else dst
        dst.mkdir()
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode: real(p, mode) and str(p) != str(blocked))
    argv = ["quantize", str(src), str(dst), "--no-progress", "--num-samples", "2", "--seq-len", "32"]
    assert main(argv + (["--overwrite"] if case == "dst read-only" else [])) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fp4moe quantize: error: ") and message in err, err
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_overwrite_of_a_file_leaves_nothing_aside(checkpoints, tmp_path):
    dst = tmp_path / "out"
    dst.write_text("an old file in the way")
    quantize(checkpoints.bf16(), dst, dataclasses.replace(FAST, overwrite=True))
    assert dst.is_dir() and (dst / "config.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no .out.old-PID
