"""The measuring pass of ``quantize --budget`` (before the quantize pass): the held-out windows split off the
calibration text, the sensitivity table measured layer by layer (or read back with ``--sensitivity``), saved
beside DST so an interrupted run can resume from it, and the search's assignment."""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from fp4moe.data.windows import consecutive_windows
from fp4moe.models import qwen3_5_moe as arch
from fp4moe.quantize import calibrate, sensitivity
from fp4moe.quantize import parts as P
from fp4moe.quantize.search import Assignment, search
from fp4moe.quantize.sensitivity import FinalLogits, Measurement, SensitivityError, SensitivityTable

HELD_OUT_FRACTION = 0.1  # the tail of the calibration text kept for measuring KL, never calibrated on
TABLE_NAME, PLOT_NAME = "sensitivity.json", "sensitivity.png"


def split_held_out(ids: list[int], options) -> tuple[list[int], torch.Tensor]:
    """(calibration ids, held-out windows [N, seq_len]): the last tenth of the calibration text (at least
    ``sensitivity_samples`` windows of ``seq_len``) is held out; calibration windows come from the rest."""
    need = options.sensitivity_samples * options.seq_len
    cut = len(ids) - max(need, int(len(ids) * HELD_OUT_FRACTION))
    if cut < options.seq_len:
        raise SensitivityError(
            f"the calibration text has {len(ids)} tokens: too few to hold out {options.sensitivity_samples} "
            f"windows of {options.seq_len} for the search and calibrate on the rest (lower --sensitivity-samples "
            "or --seq-len, or give more text)"
        )
    windows = consecutive_windows(ids[cut:], options.seq_len, need, min_len=options.seq_len)
    return ids[:cut], torch.tensor(windows[: options.sensitivity_samples])


def saved_table_path(dst: Path) -> Path:
    """Where a run keeps its measured table until the output is complete (beside DST, hidden)."""
    return dst.resolve().parent / f".{dst.name}.{TABLE_NAME}"


def fixed_bytes(reader, costs: list) -> int:
    """Bytes of every tensor the search does not choose for: the source's, less its parts' bf16 bytes."""
    return reader.total_bytes() - sum(c.bytes[P.BF16] for c in costs)


def measure_table(
    pipe, tokens: torch.Tensor, held: torch.Tensor, take, blocks, show: bool
) -> SensitivityTable:
    """The sensitivity pass: ``pipe`` (the pipeline's run state: reader, options, device, dtype, prefix,
    text config, rotary), ``take(i)`` the layer reader's, ``tokens``/``held`` the calibration and held-out
    windows. Calibration hidden states are carried only where ``--gptq`` needs Hessians."""
    t0 = time.perf_counter()
    reader, options, device, dtype = pipe.reader, pipe.options, pipe.device, pipe.dtype
    embed = reader.get(f"{pipe.prefix}embed_tokens.weight").to(device=device, dtype=dtype)
    held_hidden = F.embedding(held.to(device), embed)  # [N, S, H]
    calib_hidden = F.embedding(tokens.to(device), embed) if options.gptq else None
    itemsize = reader.info(f"{pipe.prefix}embed_tokens.weight").torch_dtype.itemsize
    del embed
    per_layer = len(P.candidates("experts", options.gptq, options.format.value == "modelopt")) + 2 * (
        2 if options.format.value == "modelopt" else 1
    )
    bar = tqdm(total=len(blocks) * per_layer, desc="sensitivity", unit="candidate", disable=not show)
    m = Measurement(held_hidden, pipe.rotary, options, device, dtype, itemsize, bar=bar)
    for i in tqdm(range(len(blocks)), desc="sensitivity layers", unit="layer", disable=not show):
        lt = take(i)
        tensors = {arch.strip_layer_prefix(n): t for n, t in lt.dense.items()}
        tensors[P.EXPERT_TENSORS[0]], tensors[P.EXPERT_TENSORS[1]] = lt.gate_up, lt.down
        layer = calibrate.build_layer(pipe.text_config, i, tensors, dtype, device)
        stats = None
        if options.gptq:
            calib_hidden, stats = calibrate.calibrate_layer(
                layer, calib_hidden, pipe.rotary, all_experts=options.calibrate_all_experts,
                batch_size=options.batch_size, hessians=True,
            )  # fmt: skip  (as the quantize pass calibrates, so GPTQ's measured KL is the written layer's)
        m.step(i, layer, tensors, stats)
        del layer, tensors, lt, stats
    bar.close()
    costs = m.finish(FinalLogits(reader, pipe.prefix, pipe.text_config, device, dtype))
    return SensitivityTable(
        fingerprint={},  # filled by the caller
        held_out_tokens=int(held.numel()),
        fixed_bytes=fixed_bytes(reader, costs),
        parts=costs,
        seconds=round(time.perf_counter() - t0, 2),
    )


def prepare(
    pipe, src: Path, dst: Path, tokens, held, layer_reader, blocks
) -> tuple[SensitivityTable, Assignment]:
    """The table (read from ``--sensitivity``, checked against this source and these settings, or measured
    and saved beside DST; ``layer_reader()`` opens the pipeline's ``LayerReader`` for the pass) and the
    search's assignment for ``options.target``."""
    options = pipe.options
    fp = sensitivity.fingerprint(src, pipe.reader, options, tokens, held)
    if options.sensitivity:
        table = SensitivityTable.load(options.sensitivity)
        table.check(fp, options.sensitivity)
    else:
        layers = layer_reader()
        try:
            table = measure_table(pipe, tokens, held, layers.take, blocks, options.progress)
        finally:
            layers.close()
        table.fingerprint = fp
        table.save(saved_table_path(dst))
        if options.progress:
            print(f"sensitivity table saved to {saved_table_path(dst)} (--sensitivity reuses it)", flush=True)
    return table, search(table, options.target)


def tracker(run, embed: torch.Tensor, held: torch.Tensor) -> sensitivity.KLTracker:
    """The quantize pass's measurement of the whole assignment, from the held-out windows' embeddings."""
    hidden = F.embedding(held.to(run.device), embed.to(device=run.device, dtype=run.dtype))
    return sensitivity.KLTracker(hidden, run.rotary, run.options, run.device, run.dtype)


def finish(run, tmp: Path, table: SensitivityTable) -> dict:
    """After the quantize pass: the assignment's measured KL, sensitivity.json and its figure written into the
    output (``tmp``), and the report's ``search`` entry."""
    from fp4moe.quantize.sensitivity_plot import plot_table

    with run.timer("measure"):
        final = FinalLogits(run.reader, run.prefix, run.text_config, run.device, run.dtype)
        run.assignment.measured_kl = run.tracker.finish(final)
    table.save(tmp / TABLE_NAME)
    plot_table(table, tmp / PLOT_NAME)
    return {
        **run.assignment.to_json(),
        "held_out_tokens": table.held_out_tokens,
        "sensitivity_seconds": table.seconds,
    }


def drop_saved_table(dst: Path, options) -> None:
    """The table kept beside DST goes once the output holds it (also when the run resumed from it)."""
    saved = saved_table_path(dst)
    if not options.sensitivity or Path(options.sensitivity).resolve() == saved:
        saved.unlink(missing_ok=True)
