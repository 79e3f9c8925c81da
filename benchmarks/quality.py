"""Quality of NVFP4 choices on a trained reference model (issue 7): quantize it with each scale method and
``--quantize`` mix, then ``fp4moe eval`` every result against the bf16 model on held-out text.

    python benchmarks/quality.py .models/reference --out quality.json \
        --methods rtn 4over6 mse --mixes experts experts,shared experts,attention,deltanet,shared

The held-out text (CPython's language reference, never trained on) is cut into ``--slices`` disjoint parts;
each model is evaluated on every part, so the table gives the mean and the spread over parts, and a
method's KL is compared with round-to-nearest's slice by slice (``wins``). Scale selection reads only the
weights, and our engine runs NVFP4 weight-only, so the calibration seed changes nothing in these numbers
(it only moves the input scales, which a W4A4 engine would use): ``--seeds`` exists to show that.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from provenance import write_result


def heldout_slices(count: int) -> list[str]:
    """The held-out text in ``count`` contiguous parts, cut at paragraph breaks."""
    from fp4moe.data import corpus_text

    text = corpus_text("heldout")
    cuts, start = [], 0
    for i in range(1, count):
        at = text.find("\n\n", i * len(text) // count)
        cuts.append(text[start:at])
        start = at
    cuts.append(text[start:])
    return cuts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reference", help="the bf16 reference checkpoint (e.g. from scripts/train_reference.py)")
    ap.add_argument("--out", default="quality.json", help="JSON results")
    ap.add_argument(
        "--methods",
        nargs="+",
        default=["rtn", "4over6", "mse"],
        help="scale methods to compare; gptq:METHOD adds GPTQ error compensation (e.g. gptq:mse)",
    )
    ap.add_argument("--seeds", nargs="+", type=int, default=[0], help="calibration sampling seeds")
    ap.add_argument(
        "--mixes", nargs="+", default=["experts"], help="--quantize values, e.g. experts experts,shared"
    )
    ap.add_argument("--slices", type=int, default=3, help="disjoint parts of the held-out text")
    ap.add_argument("--limit", type=int, default=65536, help="held-out tokens per slice at most")
    ap.add_argument("--seq-len", type=int, default=512, help="tokens per eval window")
    ap.add_argument("--num-samples", type=int, default=128, help="calibration sequences")
    ap.add_argument("--device", default="cpu", help="device for calibration and eval")
    args = ap.parse_args()

    from fp4moe.eval.quality import evaluate
    from fp4moe.quantize.options import QuantizeOptions
    from fp4moe.quantize.pipeline import quantize

    texts = heldout_slices(args.slices)

    def run_eval(model) -> list[dict]:
        return [
            asdict(evaluate(model, args.reference, text=t, seq_len=args.seq_len, limit=args.limit,
                            device=args.device, progress=False))
            for t in texts
        ]  # fmt: skip

    base = run_eval(args.reference)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mix in args.mixes:
            for method, seed in [(m, s) for m in args.methods for s in args.seeds]:
                dst = Path(tmp) / f"{mix}-{method}-{seed}"
                start = time.perf_counter()
                quantize(
                    args.reference,
                    dst,
                    QuantizeOptions(
                        scale_method=method.removeprefix("gptq:"),
                        gptq=method.startswith("gptq:"),
                        quantize_extra=mix,
                        seed=seed,
                        num_samples=args.num_samples,
                        device=args.device,
                        overwrite=True,
                        progress=False,
                    ),
                )
                seconds = time.perf_counter() - start
                size = sum(f.stat().st_size for f in dst.glob("*.safetensors"))
                rows.append(dict(mix=mix, method=method, seed=seed, quantize_seconds=seconds, bytes=size,
                                 slices=run_eval(dst)))  # fmt: skip
                kl = [s["kl_mean"] for s in rows[-1]["slices"]]
                print(f"{mix} {method} seed {seed}: KL per slice {', '.join(f'{x:.5f}' for x in kl)} "
                      f"({seconds:.0f} s to quantize, {size / 1e6:.1f} MB)", flush=True)  # fmt: skip
    write_result(args.out, dict(reference=args.reference, slices=args.slices, bf16=base, runs=rows))
    print(table(base, rows))


def table(base: list[dict], rows: list[dict]) -> str:
    def stat(values):
        return statistics.mean(values), (max(values) - min(values)) / 2

    lines = [
        "| model | MB | perplexity | KL mean (± half-range over slices) | KL p99 | top-1 agreement | MTP acceptance "
        "| KL below RTN's in |",
        "|---|---|---|---|---|---|---|---|",
    ]
    ppl = stat([s["reference_scores"]["perplexity"] for s in base])
    acc = [s["reference_scores"]["mtp_acceptance"] for s in base]
    acc_s = "-" if acc[0] is None else f"{statistics.mean(acc):.1%}"
    lines.append(f"| bf16 | - | {ppl[0]:.3f} ± {ppl[1]:.3f} | 0 | 0 | 100% | {acc_s} | - |")
    for r in rows:
        if r["seed"] != rows[0]["seed"]:
            continue
        sl = r["slices"]
        kl = stat([s["kl_mean"] for s in sl])
        rtn = next(
            (x for x in rows if x["mix"] == r["mix"] and x["method"] == "rtn" and x["seed"] == r["seed"]),
            None,
        )
        wins = "-" if rtn is None or r["method"] == "rtn" else (
            f"{sum(a['kl_mean'] < b['kl_mean'] for a, b in zip(sl, rtn['slices'], strict=True))}/{len(sl)} slices"
        )  # fmt: skip
        acc = [s["model_scores"]["mtp_acceptance"] for s in sl]
        acc_s = "-" if acc[0] is None else f"{statistics.mean(acc):.1%}"
        lines.append(
            f"| {r['mix']} / {r['method']} | {r['bytes'] / 1e6:.1f} | "
            f"{statistics.mean(s['model_scores']['perplexity'] for s in sl):.3f} | {kl[0]:.5f} ± {kl[1]:.5f} | "
            f"{statistics.mean(s['kl_p99'] for s in sl):.4f} | {statistics.mean(s['top1_agreement'] for s in sl):.2%} | "
            f"{acc_s} | {wins} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
