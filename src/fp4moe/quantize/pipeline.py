"""``quantize(src, dst, options)``: read -> calibrate -> quantize -> write, one decoder layer at a time.

The next layer is read (and checked for NaN/Inf) on a worker thread while this one is calibrated, quantized
and written (``LayerReader``), so the disk and the arithmetic overlap. Peak host memory is one decoder
layer's working set (its bf16 tensors, a compute copy, the quantized experts) plus the calibration
activations plus at most one output shard -- independent of the number of layers. The next layer's stored
tensors, read ahead, stay under it (7.98 GB on 8 full-size layers with and without ``--no-read-ahead``).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import resource
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from fp4moe.data.windows import random_windows
from fp4moe.formats import kv_scales, layouts
from fp4moe.formats.checkpoint import (
    INDEX_NAME,
    CheckpointReader,
    ShardedWriter,
    atomic_output_dir,
    check_destination,
    copy_side_files,
    recover_interrupted_output,
    write_json,
)
from fp4moe.formats.nvfp4 import BLOCK_SIZE, NVFP4Error
from fp4moe.layers.norm import rms_norm_zero_centred
from fp4moe.models import qwen3_5_moe as arch
from fp4moe.quantize import calib_data, calibrate, card, extra
from fp4moe.quantize.experts import quantize_experts
from fp4moe.quantize.options import QuantizeError, QuantizeOptions, QuantizeReport
from fp4moe.quantize.writing import quantization_configs, write_experts, write_linear_group

MTP_FILE = "model-mtp.safetensors"


def _release_freed_memory() -> None:
    """Hand freed heap pages back to the OS (glibc keeps them otherwise, and RSS creeps up layer by layer)."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to do
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class StageTimer:
    """Wall seconds spent per pipeline stage (read, calibrate, quantize, write)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, stage: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - t


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _finite(name: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` unchanged, or NVFP4Error if it holds NaN/Inf (checked a slice at a time: no full-size mask)."""
    if t.is_floating_point():
        for part in t.reshape(-1).split(1 << 24):
            if not torch.isfinite(part).all():
                raise NVFP4Error(f"{name}: contains NaN or Inf values")
    return t


def _load_tokenizer(src: Path):
    from transformers import AutoTokenizer

    if not any((src / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        raise QuantizeError(
            f"{src}: no tokenizer files (tokenizer.json / tokenizer_config.json) for calibration"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(src), trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise QuantizeError(f"{src}: cannot load a tokenizer for calibration ({e})") from None
    if len(tokenizer) <= 1:
        raise QuantizeError(f"{src}: the tokenizer is empty; it cannot tokenize calibration text")
    return tokenizer


def calibration_token_ids(
    src: Path, cfg: arch.ModelConfig, options: QuantizeOptions
) -> tuple[torch.Tensor, str]:
    tokens, _, source = calibration_windows(src, cfg, options)
    return tokens, source


def calibration_windows(
    src: Path, cfg: arch.ModelConfig, options: QuantizeOptions
) -> tuple[torch.Tensor, torch.Tensor | None, str]:
    """(calibration windows [num_samples, seq_len], held-out windows for the format search or None, source).
    With a search target the tail of the text is held out (``search_pass.split_held_out``)."""
    text, source = calib_data.calibration_text(options.calib_file, options.calib_dataset)
    tokenizer = _load_tokenizer(src)
    ids = calib_data.tokenize(tokenizer, text)
    held = None
    if options.target is not None:
        from fp4moe.quantize.search_pass import split_held_out

        ids, held = split_held_out(ids, options)
    tokens = random_windows(ids, options.num_samples, options.seq_len, options.seed)
    top = max(int(tokens.max()), -1 if held is None else int(held.max()))
    if top >= cfg.text.vocab_size:
        raise QuantizeError(f"tokenizer produced id {top} >= vocab_size {cfg.text.vocab_size}")
    return tokens, held, source


def _validate_dims(cfg: arch.ModelArgs) -> None:
    for what, dim in (("hidden_size", cfg.hidden_size), ("moe_intermediate_size", cfg.moe_intermediate_size)):
        if dim % BLOCK_SIZE:
            raise NVFP4Error(f"{what} {dim} is not divisible by the NVFP4 group size {BLOCK_SIZE}")


@dataclass
class _Run:
    """What one ``quantize`` run carries from layer to layer: its inputs, the writer, and the tallies the
    report and the config need."""

    reader: CheckpointReader
    writer: ShardedWriter
    options: QuantizeOptions
    prefix: str
    text_config: object  # transformers' text config (calibration runs its decoder layer)
    rotary: object
    device: torch.device
    dtype: torch.dtype
    timer: StageTimer
    done: set[str] = field(default_factory=set)  # tensors written
    quantized_modules: dict[str, str] = field(default_factory=dict)  # --quantize linears -> nvfp4 | fp8
    fallbacks: list[list[int]] = field(default_factory=list)  # [layer, expert] with no calibration token
    num_calibrated: int = 0
    min_tokens: int | None = None
    assignment: object = None  # search.Assignment under --budget & co: the formats of each layer's parts
    tracker: object = None  # sensitivity.KLTracker: the measured KL of the assignment, on held-out windows


@dataclass
class _LayerTensors:
    """One decoder layer's tensors as stored, checked finite: the dense ones by name, the routed experts fused."""

    names: list[str]
    dense: dict[str, torch.Tensor]
    gate_up: torch.Tensor
    down: torch.Tensor


def _read_layer(reader: CheckpointReader, prefix: str, i: int, block, timer: StageTimer) -> _LayerTensors:
    with timer("read"):
        names = arch.layer_names(reader, prefix, i)
        expert_names = set(block.source_names())
        dense = {n: _finite(n, reader.get(n)) for n in names if n not in expert_names}
        gate_up, down = block.read(reader)
        _finite(f"{block.prefix}gate_up_proj", gate_up)
        _finite(f"{block.prefix}down_proj", down)
    return _LayerTensors(names, dense, gate_up, down)


class LayerReader:
    """The decoder layers' tensors in order, each read one layer ahead on a worker thread: ``take(i)`` hands
    over layer i (waiting for its read where it is not done) and starts reading layer i + 1, so the disk works
    while the caller calibrates, quantizes and writes layer i. A read's error (a missing tensor, NaN) is
    raised by the ``take`` of its layer. ``ahead=False``: each layer read in ``take``, on the caller's thread.

    Stage times: "read" is the reading itself (on the worker, beside the other stages when ahead), "read wait"
    the time ``take`` spent waiting for it."""

    def __init__(self, reader: CheckpointReader, prefix: str, blocks: list, timer: StageTimer, ahead: bool):
        self.reader, self.prefix, self.blocks, self.timer = reader, prefix, blocks, timer
        self.pending: tuple[int, Future] | None = None
        self.pool = None
        if ahead:
            # The worker's own torch ops (the NaN checks, stacking per-expert tensors) run on one thread: once
            # a second thread had run a parallel op, torch's OpenMP teams contended for the cores and every op
            # of the caller's quantize stage ran 2.8x slower (2 cores). torch.set_num_threads is per thread
            # for a thread already started (the caller's team stays as it is: asked for here first) but also
            # the default of threads started later, so ``close`` puts that back.
            self.threads = torch.get_num_threads()
            self.pool = ThreadPoolExecutor(
                1, thread_name_prefix="fp4moe-read", initializer=torch.set_num_threads, initargs=(1,)
            )

    def _read(self, i: int) -> _LayerTensors:
        return _read_layer(self.reader, self.prefix, i, self.blocks[i], self.timer)

    def take(self, i: int) -> _LayerTensors:
        if self.pool is None:
            return self._read(i)
        if self.pending is None or self.pending[0] != i:  # the first layer, or out of order: read it now
            self.pending = (i, self.pool.submit(self._read, i))
        future = self.pending[1]
        self.pending = None  # the reader keeps no reference to the tensors it hands over
        with self.timer("read wait"):
            layer = future.result()
        del future
        if i + 1 < len(self.blocks):
            self.pending = (i + 1, self.pool.submit(self._read, i + 1))
        return layer

    def close(self) -> None:
        """Stop: a read in flight is cancelled, or finishes on its own and is dropped."""
        self.pending = None
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.pool = None
            torch.set_num_threads(self.threads)


def _quantize_layer(run: _Run, i: int, block, hidden: torch.Tensor, tensors: _LayerTensors) -> torch.Tensor:
    """Decoder layer ``i`` (``tensors``: as read by ``LayerReader``): calibrate it on ``hidden`` (the previous
    layer's outputs, returned for the next), quantize its routed experts (and its ``--quantize`` groups), write
    it, free it."""
    options, timer, device = run.options, run.timer, run.device
    names, dense, gate_up, down = tensors.names, tensors.dense, tensors.gate_up, tensors.down
    del tensors
    with timer("calibrate"):
        layer_tensors = {arch.strip_layer_prefix(n): t for n, t in dense.items()}
        layer_tensors["mlp.experts.gate_up_proj"] = gate_up
        layer_tensors["mlp.experts.down_proj"] = down
        layer = calibrate.build_layer(run.text_config, i, layer_tensors, run.dtype, device)
        modules = {n.removesuffix(".weight") for n in layer_tensors if n.endswith(".weight")}
        if run.assignment is not None:
            groups = run.assignment.layer_groups(i)
            gptq = run.assignment.experts_gptq(i)
        else:
            groups, gptq = arch.layer_groups(options.quantize_extra, modules), options.gptq
        taps = extra.InputAmax(layer, [m for g, _ in groups for m in g])
        attention = run.text_config.layer_types[i] == "full_attention"
        kv_tap = calibrate.KVTap() if options.kv_cache_quant_algo == "FP8" and attention else None
        try:
            hidden, stats = calibrate.calibrate_layer(
                layer,
                hidden,
                run.rotary,
                all_experts=options.calibrate_all_experts,
                batch_size=options.batch_size,
                hessians=gptq,
                kv_tap=kv_tap,
            )
        finally:
            taps.remove()
    if run.tracker is not None:
        with timer("measure"):
            chosen = {part: fmt for (j, part), fmt in run.assignment.formats.items() if j == i}
            run.tracker.step(layer, layer_tensors, chosen, stats)
    del layer, layer_tensors
    with timer("quantize"):
        # the checkpoint's own values (not the calibration-dtype copy), on the device
        q = quantize_experts(
            gate_up.to(device), down.to(device), stats, options.scale_method, name=block.prefix
        )
    with timer("write"):
        head = f"{run.prefix}layers.{i}."
        for group, algo in groups:
            weights = {head + m: dense.pop(f"{head}{m}.weight") for m in group}
            in_amax = torch.stack([taps.amax[m] for m in group]).max()
            write_linear_group(
                run.writer, options.format, weights, in_amax, options.scale_method, device, algo
            )
            run.quantized_modules.update(dict.fromkeys(weights, algo))
        for name, t in dense.items():
            run.writer.add(name, t)
        write_experts(run.writer, options.format, block.prefix, q)
        if kv_tap is not None:
            for name, amax in zip(
                kv_scales.names(options.format, head), kv_tap.amax.amax(dim=1), strict=True
            ):
                run.writer.add(name, kv_scales.scale_from_amax(amax))
    run.fallbacks += [[i, int(e)] for e in q.fallback.nonzero().flatten()]
    run.num_calibrated += int(stats.calibrated.sum())
    seen = stats.num_tokens[stats.calibrated]
    if seen.numel():
        run.min_tokens = int(seen.min()) if run.min_tokens is None else min(run.min_tokens, int(seen.min()))
    run.done.update(names)
    del dense, gate_up, down, q
    _release_freed_memory()
    return hidden


def _write_rest(run: _Run, hidden: torch.Tensor, mtp_names: list[str]) -> None:
    """After the layers: lm_head (quantized where ``--quantize lm_head`` asks, its input scale from the last
    layer's normed outputs), every tensor not written yet, and the MTP head's tensors verbatim in their own
    file."""
    reader, options = run.reader, run.options
    head_algo = dict(arch.split(o) for o in options.quantize_extra).get("lm_head")
    if head_algo is not None:
        if "lm_head.weight" not in reader:
            raise QuantizeError("--quantize lm_head: the checkpoint ties lm_head to the embedding")
        norm = reader.get(f"{run.prefix}norm.weight").to(device=run.device, dtype=run.dtype)
        eps = float(getattr(run.text_config, "rms_norm_eps", 1e-6))
        head_in = rms_norm_zero_centred(hidden, norm, eps).abs().amax().float().cpu()
        weights = {"lm_head": _finite("lm_head.weight", reader.get("lm_head.weight"))}
        write_linear_group(
            run.writer, options.format, weights, head_in, options.scale_method, run.device, head_algo
        )
        run.quantized_modules["lm_head"] = head_algo
        run.done.add("lm_head.weight")
    for name in tqdm(
        [n for n in reader.names() if n not in run.done and not n.startswith("mtp.")],
        desc="other tensors",
        unit="tensor",
        disable=not options.progress,
    ):
        run.writer.add(name, _finite(name, reader.get(name)))
    if mtp_names:
        run.writer.write_file(MTP_FILE, {n: _finite(n, reader.get(n)) for n in mtp_names})


def _write_config(run: _Run, cfg, tmp: Path, src: Path, has_mtp: bool, recipe: dict) -> None:
    """config.json with the quantization_config (and ModelOpt's hf_quant_config.json): the exclude list of
    every module left in bf16, by the names in the shards; MIXED_PRECISION where some groups are FP8. A
    config that declares MTP layers the source does not have declares none. The source's side files
    (tokenizer, processor, generation config) are copied, not its model card (``card`` writes ours). The
    recipe goes into hf_quant_config.json (vLLM reads only its ``quantization`` entry there); compressed-tensors'
    config gets none (its schema may forbid unknown keys), the card carries it."""
    reader, options = run.reader, run.options
    tensors = {
        n: (reader.info(n).dtype, reader.info(n).shape)
        for n in reader.names()
        if not arch.is_routed_expert(n) and n.removesuffix(".weight") not in run.quantized_modules
    }
    exclude = layouts.excluded_modules(tensors, options.format, arch.is_routed_expert)
    qcfg, hf_qcfg = quantization_configs(options.format, exclude, options.kv_cache_quant_algo)
    if arch.uses_fp8(options.quantize_extra) or "fp8" in run.quantized_modules.values():
        # some FP8, some NVFP4: ModelOpt MIXED_PRECISION
        layers = {f"{run.prefix}layers.{i}.mlp.experts": "nvfp4" for i in range(cfg.text.num_layers)}
        layers.update(run.quantized_modules)
        qcfg, hf_qcfg = layouts.modelopt_mixed_configs(exclude, options.kv_cache_quant_algo, layers)
    raw = json.loads(json.dumps(cfg.raw))
    raw["quantization_config"] = qcfg
    if not has_mtp:
        text_cfg = arch.text_config_dict(raw)
        if text_cfg.get("mtp_num_hidden_layers"):
            text_cfg["mtp_num_hidden_layers"] = 0
    write_json(tmp / "config.json", raw)
    if hf_qcfg is not None:
        write_json(tmp / "hf_quant_config.json", {**hf_qcfg, "fp4moe_recipe": recipe})
    copy_side_files(src, tmp, skip={"config.json", INDEX_NAME, "hf_quant_config.json", card.CARD_NAME})


def _refuse_quantized_source(src: Path, config: dict) -> None:
    """SRC must be the bf16 checkpoint: one that is already quantized (its config's ``quantization_config``,
    or ModelOpt's hf_quant_config.json) would be read as garbage weights."""
    qc = config.get("quantization_config") or config.get("text_config", {}).get("quantization_config")
    if qc is None and not (src / "hf_quant_config.json").exists():
        return
    method = (qc or {}).get("quant_method", "modelopt")
    raise QuantizeError(
        f"{src} is already quantized ({method}); quantize reads the bf16 source checkpoint -- pass that "
        "(`fp4moe inspect` checks a quantized one, `fp4moe convert` changes its layout)"
    )


def quantize(src: str | Path, dst: str | Path, options: QuantizeOptions | None = None) -> QuantizeReport:
    """Quantize the routed experts of a bf16 qwen3_5_moe checkpoint to NVFP4; everything else verbatim: one
    decoder layer at a time (``_quantize_layer``), then the rest and the config, written to a temporary
    directory that is inspected against the source before it is renamed into place."""
    from fp4moe.quantize.inspect import inspect_checkpoint

    options = options or QuantizeOptions()
    t0 = time.perf_counter()
    src, dst = Path(src), Path(dst)
    check_destination(dst, options.overwrite)
    recover_interrupted_output(dst.resolve())
    if dst.exists() and not options.overwrite:
        raise FileExistsError(f"{dst} already exists; pass --overwrite to replace it")
    if dst.resolve() == src.resolve():
        raise QuantizeError("DST must differ from SRC")
    cfg = arch.ModelConfig.from_dir(src)
    _refuse_quantized_source(src, cfg.raw)
    device = options.resolve_device()
    reader = CheckpointReader(src)
    _validate_dims(cfg.text)
    prefix = arch.text_prefix(reader)
    blocks = [
        arch.expert_block(reader, f"{prefix}layers.{i}.mlp.experts.", cfg.text)
        for i in range(cfg.text.num_layers)
    ]
    mtp_names = [n for n in reader.names() if n.startswith("mtp.")]
    layouts_seen = {"main": blocks[0].layout.value}
    mtp_layout = arch.detect_expert_layout(reader, "mtp.layers.0.mlp.experts.")
    if mtp_layout is not None:
        layouts_seen["mtp"] = mtp_layout.value
    warnings: list[str] = []
    if cfg.text.mtp_num_hidden_layers and not mtp_names:
        # transformers drops mtp.* at load but keeps the config key, so re-saved derivatives look like this
        warnings.append(
            f"config declares {cfg.text.mtp_num_hidden_layers} MTP layer(s) but SRC has no mtp.* tensors "
            "(a transformers re-save?); the output declares none"
        )

    dtype = options.resolve_dtype(reader.info(f"{prefix}embed_tokens.weight").torch_dtype or torch.float32)
    timer = StageTimer()
    with timer("tokenize"):
        tokens, held, source = calibration_windows(src, cfg, options)
    text_config = calibrate.text_config_for(cfg.raw)
    show = options.progress
    table = assignment = None
    if options.target is not None:
        from fp4moe.quantize import search_pass

        pipe = _Run(reader, None, options, prefix, text_config, calibrate.rotary_for(text_config, device),
                    device, dtype, timer)  # fmt: skip

        def layer_reader() -> LayerReader:
            return LayerReader(reader, prefix, blocks, timer, ahead=options.read_ahead)

        with timer("sensitivity"):
            table, assignment = search_pass.prepare(pipe, src, dst, tokens, held, layer_reader, blocks)

    with atomic_output_dir(dst, overwrite=options.overwrite) as tmp:
        writer = ShardedWriter(tmp, options.max_shard_bytes)
        run = _Run(reader, writer, options, prefix, text_config, calibrate.rotary_for(text_config, device),
                   device, dtype, timer)  # fmt: skip
        embed_name = f"{prefix}embed_tokens.weight"
        embed = _finite(embed_name, reader.get(embed_name))
        hidden = F.embedding(tokens.to(device), embed.to(device=device, dtype=dtype))  # [B, S, H]
        if assignment is not None:
            run.assignment, run.tracker = assignment, search_pass.tracker(run, embed, held)
        writer.add(embed_name, embed)
        run.done.add(embed_name)
        del embed

        layer_bar = tqdm(blocks, desc="layers", unit="layer", disable=not show, position=0)
        expert_bar = tqdm(
            total=len(blocks) * cfg.text.num_experts,
            desc="experts",
            unit="expert",
            disable=not show,
            position=1,
        )
        shard_bar = tqdm(desc="shards written", unit="shard", disable=not show, position=2)
        writer.on_flush = lambda index: shard_bar.update(1)
        layers = LayerReader(reader, prefix, blocks, timer, ahead=options.read_ahead)
        try:
            for i, block in enumerate(layer_bar):
                hidden = _quantize_layer(run, i, block, hidden, layers.take(i))
                expert_bar.update(block.num_experts)
                expert_bar.set_postfix(calibrated=run.num_calibrated, fallbacks=len(run.fallbacks))
        finally:
            layers.close()
        with timer("write"):
            _write_rest(run, hidden, mtp_names)
            writer.close()
        for bar in (layer_bar, expert_bar, shard_bar):
            bar.close()
        search = None if assignment is None else search_pass.finish(run, tmp, table)
        _write_config(
            run, cfg, tmp, src, bool(mtp_names), card.recipe(options, source, int(tokens.numel()), search)
        )

        with timer("inspect"):
            check = inspect_checkpoint(tmp, reference=reader)
        if not check.ok:
            raise QuantizeError("the written checkpoint failed inspection:\n  " + "\n  ".join(check.problems))
        bytes_out = sum(p.stat().st_size for p in tmp.glob("*.safetensors"))
        num_quantized = cfg.text.num_layers * cfg.text.num_experts
        report = QuantizeReport(
            src=str(src),
            dst=str(dst),
            format=options.format.value,
            num_layers=cfg.text.num_layers,
            num_experts=cfg.text.num_experts,
            expert_layouts=layouts_seen,
            calibration=source,
            calibration_tokens=int(tokens.numel()),
            device=str(device),
            calib_dtype=str(dtype).removeprefix("torch."),
            bytes_in=reader.total_bytes(),
            bytes_out=bytes_out,
            experts_quantized=num_quantized,
            experts_calibrated=run.num_calibrated,
            warnings=warnings,
            fallback_experts=run.fallbacks,
            min_tokens_per_expert=run.min_tokens or 0,
            seconds=time.perf_counter() - t0,
            stage_seconds={k: round(v, 2) for k, v in timer.seconds.items()},
            peak_rss_bytes=peak_rss_bytes(),
            search=search,
        )
        check.path = dst.name  # the card names the checkpoint, not its temporary folder
        card.write_card(tmp, src, dst, options, report, check.table(), cfg.raw, cfg.has_vision)
    if options.target is not None:
        search_pass.drop_saved_table(dst, options)
    report.seconds = time.perf_counter() - t0
    return report
