"""The next decoder layer is read on a worker thread while this one is quantized (``pipeline.LayerReader``):
the output is the same bytes as reading each layer when it is needed, the reads really overlap the
calibration, and a later layer's read error still leaves nothing written."""

import threading

import pytest
import torch

from fixtures import load_all, rewrite_tensors
from fp4moe.formats.nvfp4 import NVFP4Error
from fp4moe.quantize import calibrate, pipeline
from fp4moe.quantize.options import QuantizeOptions

FAST = dict(num_samples=2, seq_len=32, progress=False)


def _shards(path):
    return {p.name: p.read_bytes() for p in sorted(path.glob("*.safetensors"))}


def test_read_ahead_writes_the_same_bytes_as_reading_on_demand(checkpoints, tmp_path):
    src = checkpoints.bf16()
    ahead = pipeline.quantize(src, tmp_path / "ahead", QuantizeOptions(**FAST))
    on_demand = pipeline.quantize(src, tmp_path / "on-demand", QuantizeOptions(read_ahead=False, **FAST))
    a, b = _shards(tmp_path / "ahead"), _shards(tmp_path / "on-demand")
    assert a.keys() == b.keys() and len(a) > 1
    for name in a:
        assert a[name] == b[name], name
    assert "read wait" in ahead.stage_seconds and "read wait" not in on_demand.stage_seconds
    assert "read" in ahead.stage_seconds and "read" in on_demand.stage_seconds


def _watch_layer_1_read(monkeypatch, wait_s: float) -> dict:
    """Layer 0's calibration waits up to ``wait_s`` for layer 1's read to start, and records whether it did."""
    started, seen = threading.Event(), {}
    read, calibrate_layer = pipeline._read_layer, calibrate.calibrate_layer

    def watched_read(reader, prefix, i, block, timer):
        if i == 1:
            started.set()
        return read(reader, prefix, i, block, timer)

    def watched_calibrate(layer, hidden, *args, **kwargs):
        if "calibrate_0" not in seen:
            seen["calibrate_0"] = started.wait(wait_s)
        return calibrate_layer(layer, hidden, *args, **kwargs)

    monkeypatch.setattr(pipeline, "_read_layer", watched_read)
    monkeypatch.setattr(calibrate, "calibrate_layer", watched_calibrate)
    return seen


def test_the_next_layer_is_read_while_this_one_calibrates(checkpoints, tmp_path, monkeypatch):
    seen = _watch_layer_1_read(monkeypatch, wait_s=60)
    pipeline.quantize(checkpoints.bf16(), tmp_path / "out", QuantizeOptions(**FAST))
    assert seen == {"calibrate_0": True}


def test_without_read_ahead_nothing_is_read_before_it_is_needed(checkpoints, tmp_path, monkeypatch):
    seen = _watch_layer_1_read(monkeypatch, wait_s=0.5)
    pipeline.quantize(checkpoints.bf16(), tmp_path / "out", QuantizeOptions(read_ahead=False, **FAST))
    assert seen == {"calibrate_0": False}


@pytest.mark.parametrize("read_ahead", [True, False])
def test_a_read_error_in_the_last_layer_fails_the_run_and_writes_nothing(checkpoints, tmp_path, read_ahead):
    src = checkpoints.copy(checkpoints.bf16(), f"nan-{read_ahead}")
    tensors = load_all(src)
    last = max(int(n.split(".")[3]) for n in tensors if n.startswith("model.language_model.layers."))
    name = f"model.language_model.layers.{last}.post_attention_layernorm.weight"
    tensors[name] = tensors[name].clone()
    tensors[name][3] = float("inf")
    rewrite_tensors(src, tensors)
    dst = tmp_path / "out"
    with pytest.raises(
        NVFP4Error, match=f"layers.{last}.post_attention_layernorm.weight: contains NaN or Inf"
    ):
        pipeline.quantize(src, dst, QuantizeOptions(read_ahead=read_ahead, **FAST))
    assert not dst.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.")] == []


def test_layer_reader_hands_over_each_layer_once_and_keeps_no_reference(checkpoints):
    reader = pipeline.CheckpointReader(checkpoints.bf16())
    cfg = pipeline.arch.ModelConfig.from_dir(checkpoints.bf16())
    prefix = pipeline.arch.text_prefix(reader)
    blocks = [
        pipeline.arch.expert_block(reader, f"{prefix}layers.{i}.mlp.experts.", cfg.text)
        for i in range(cfg.text.num_layers)
    ]
    layers = pipeline.LayerReader(reader, prefix, blocks, pipeline.StageTimer(), ahead=True)
    try:
        for i in range(len(blocks)):
            layer = layers.take(i)
            assert all(f"layers.{i}." in n for n in layer.names)
            assert torch.equal(layer.gate_up, blocks[i].read(reader)[0])
            # what is pending is the next layer's read, never this layer's tensors
            assert layers.pending is None if i + 1 == len(blocks) else layers.pending[0] == i + 1
    finally:
        layers.close()


def test_the_worker_runs_torch_on_one_thread_and_the_caller_keeps_its_own(checkpoints, monkeypatch):
    """A second thread's parallel torch ops made the caller's 2.8x slower (OpenMP teams contending): the
    worker runs on one thread; the caller's thread count, and the default for later threads, stay. The caller
    runs on two threads here: under xdist conftest.py already set one, and the worker's one would be no news."""
    original = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _worker_on_one_thread(checkpoints, monkeypatch)
    finally:
        torch.set_num_threads(original)


def _worker_on_one_thread(checkpoints, monkeypatch):
    reader = pipeline.CheckpointReader(checkpoints.bf16())
    cfg = pipeline.arch.ModelConfig.from_dir(checkpoints.bf16())
    prefix = pipeline.arch.text_prefix(reader)
    blocks = [pipeline.arch.expert_block(reader, f"{prefix}layers.0.mlp.experts.", cfg.text)]
    before, seen = torch.get_num_threads(), []
    assert before == 2
    read = pipeline._read_layer

    def watched(*args):
        seen.append(torch.get_num_threads())
        return read(*args)

    monkeypatch.setattr(pipeline, "_read_layer", watched)
    layers = pipeline.LayerReader(reader, prefix, blocks, pipeline.StageTimer(), ahead=True)
    layers.take(0)
    assert torch.get_num_threads() == before
    layers.close()
    assert seen == [1] and torch.get_num_threads() == before
    later = []
    t = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
    t.start()
    t.join()
    assert later == [before]
