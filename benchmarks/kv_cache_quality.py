"""What an fp8 KV cache costs in quality, by where its scales come from: KL(bf16 cache ‖ fp8 cache) on held-out
text, per prompt length, on the CPU engine (the trained reference model: scripts/train_reference.py).

    python benchmarks/kv_cache_quality.py .models/reference --lengths 1024 2048 4096 8192 --out kv.json

Each window of the held-out text (CPython's language reference, never trained on) is one teacher-forced
prefill; every position's next-token distribution with the fp8 cache is compared with the bf16 cache's (the
same bf16 weights: only the cache differs). Within a prefill the attention reads the keys and values as
stored (through fp8 and back), as vLLM's does, so every position after the first sees the cache's rounding.
The scale rules:

- ``checkpoint``: ``fp4moe quantize --kv-cache-dtype fp8``'s calibrated scales (amax / 448 over the
  calibration tokens; what vLLM and fp4moe read from the checkpoint);
- ``startup``: the engine's rule for a checkpoint without scales (``engine.loading.kv_scales``: the packaged text,
  amax x 1.25 / 448); ``startup-1.0``: the same without headroom;
- ``unit``: 1.0, vLLM's fallback when a checkpoint has no scales;
- ``first-request``: fp4moe's former rule after a one-token first request (that token's k/v amax x 2 / 448);
- ``checkpoint-2x``, ``startup-2.0``: the checkpoint's scales doubled, start-up calibration with 2x headroom
  (whether headroom over the calibration amax pays on text the calibration did not see).

``--rules`` picks some; ``--scales-from`` takes the ``checkpoint`` scales from an earlier result file instead of
quantizing again.

The cache arithmetic is vLLM's: per-tensor e4m3, the scale divides on write (saturating at 448) and
multiplies on read.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from provenance import write_result

RULES = ["checkpoint", "startup", "startup-1.0", "unit", "first-request", "checkpoint-2x", "startup-2.0"]


def _windows(tokenizer, lengths: list[int], per_length: int) -> dict[int, list[list[int]]]:
    """``per_length`` disjoint windows of each length from the held-out text, from its start."""
    from fp4moe.data import corpus_text

    ids = tokenizer(corpus_text("heldout"), add_special_tokens=False)["input_ids"]
    out = {}
    for n in lengths:
        if n * per_length > len(ids):
            raise SystemExit(f"the held-out text has {len(ids)} tokens: too few for {per_length} x {n}")
        out[n] = [ids[i * n : (i + 1) * n] for i in range(per_length)]
    return out


def checkpoint_scales(model_dir: Path, num_samples: int, seq_len: int) -> dict:
    """The scales ``fp4moe quantize --kv-cache-dtype fp8`` writes for this model (its default calibration)."""
    from fp4moe.formats import kv_scales
    from fp4moe.formats.checkpoint import CheckpointReader
    from fp4moe.models import qwen3_5_moe as arch
    from fp4moe.quantize.options import QuantizeOptions
    from fp4moe.quantize.pipeline import quantize

    with tempfile.TemporaryDirectory() as tmp:
        dst = Path(tmp) / "q"
        options = QuantizeOptions(
            kv_cache_quant_algo="FP8", num_samples=num_samples, seq_len=seq_len, progress=False
        )
        quantize(model_dir, dst, options)
        reader = CheckpointReader(dst)
        found = kv_scales.find(reader.names(), arch.layer_of)
        return {i: tuple(reader.get(names[k]).float() for k in "kv") for i, names in found.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path, help="a bf16 checkpoint (the trained reference model)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192], help="prompt lengths")
    ap.add_argument("--windows", type=int, default=2, help="windows of each length (default 2)")
    ap.add_argument("--num-samples", type=int, default=128, help="quantize's calibration samples (128)")
    ap.add_argument("--seq-len", type=int, default=512, help="quantize's calibration length (512)")
    ap.add_argument(
        "--rules", nargs="+", choices=RULES, default=RULES[:5], help="scale rules (default: the first 5)"
    )
    ap.add_argument(
        "--scales-from", type=Path, help="an earlier result file: its checkpoint scales, not a new quantize"
    )
    ap.add_argument("--out", type=Path, required=True, help="where to write the JSON results")
    args = ap.parse_args()

    from fp4moe.engine.front.llm import LLM
    from fp4moe.engine.loading import kv_scales
    from fp4moe.eval.quality import window_outputs
    from fp4moe.layers.divergence import token_kl, top1_agrees

    cpu = torch.device("cpu")
    ref = LLM(args.model, dtype="bfloat16", device="cpu")
    fp8 = LLM(args.model, dtype="bfloat16", device="cpu", kv_cache_dtype="fp8")
    model = fp8.model
    one = [fp8.tokenizer("The", add_special_tokens=False)["input_ids"][0]]
    calib = kv_scales.calibration_ids(fp8.tokenizer, model.args.vocab_size)
    layers = sorted(fp8.runner.kv_scales)
    startup = kv_scales.calibrate(model, calib, cpu)
    if args.scales_from:
        saved = json.loads(args.scales_from.read_text())["scales"]["checkpoint"]
        ckpt = {int(i): tuple(torch.tensor(x) for x in kv) for i, kv in saved.items()}
    elif {"checkpoint", "checkpoint-2x"} & set(args.rules):
        ckpt = checkpoint_scales(args.model, args.num_samples, args.seq_len)
    make = {
        "checkpoint": lambda: ckpt,
        "startup": lambda: startup,
        "startup-1.0": lambda: kv_scales.calibrate(model, calib, cpu, headroom=1.0),
        "unit": lambda: {i: (torch.tensor(1.0), torch.tensor(1.0)) for i in layers},
        "first-request": lambda: kv_scales.calibrate(model, one, cpu, headroom=2.0),
        "checkpoint-2x": lambda: {i: (2 * k, 2 * v) for i, (k, v) in ckpt.items()},
        "startup-2.0": lambda: kv_scales.calibrate(model, calib, cpu, headroom=2.0),
    }
    rules = {name: make[name]() for name in args.rules}
    for name, scales in rules.items():  # quantize does not run the MTP head: its layer as at start-up
        rules[name] = {i: scales.get(i, startup[i]) for i in layers}
    windows = _windows(fp8.tokenizer, args.lengths, args.windows)
    rows = []
    for n, group in windows.items():
        refs = [window_outputs(ref, ids)[0] for ids in group]
        for name, scales in rules.items():
            fp8.runner.set_kv_scales(scales)
            start = time.perf_counter()
            kls, top1 = [], []
            for ids, r in zip(group, refs, strict=True):
                got = window_outputs(fp8, ids)[0]
                kls.append(token_kl(r, got))
                top1.append(top1_agrees(r, got).float())
            kl = torch.cat(kls)
            row = dict(
                rule=name, length=n, windows=len(group), kl_mean=float(kl.mean()), kl_median=float(kl.median()),
                kl_p99=float(kl.quantile(0.99)), kl_max=float(kl.max()), top1=float(torch.cat(top1).mean()),
                kl_by_window=[float(k.mean()) for k in kls], seconds=time.perf_counter() - start,
            )  # fmt: skip
            rows.append(row)
            print(f"{n:>5} {name:<14} KL mean {row['kl_mean']:.2e}  p99 {row['kl_p99']:.2e}  "
                  f"max {row['kl_max']:.2e}  top-1 {row['top1']:.2%}", flush=True)  # fmt: skip
    summary = {name: statistics.mean(r["kl_mean"] for r in rows if r["rule"] == name) for name in rules}
    scales = {
        name: {str(i): [float(k), float(v)] for i, (k, v) in sorted(s.items())} for name, s in rules.items()
    }
    write_result(
        args.out,
        dict(model=str(args.model), lengths=args.lengths, rows=rows, kl_mean_by_rule=summary, scales=scales),
        repeats=1,  # each figure is one run: a mean over every position of the windows
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
