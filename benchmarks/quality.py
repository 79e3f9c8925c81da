"""Quality of NVFP4 choices on a trained reference model (issue 7): quantize it with each scale method and
calibration seed, then ``fp4moe eval`` every result against the bf16 model on held-out text.

    python benchmarks/quality.py REFERENCE_MODEL --out quality.json --device cuda \
        --methods rtn 4over6 mse --seeds 0 1 2 --limit 16384 --mixes experts experts,shared,attention

Calibration seed = which windows of the calibration text are drawn; each (method, seed) is quantized
from scratch. Prints a markdown table (mean over seeds, and the spread) and writes every number as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from dataclasses import asdict
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reference", help="the bf16 reference checkpoint (e.g. from scripts/train_reference.py)")
    ap.add_argument("--out", default="quality.json", help="JSON results")
    ap.add_argument("--methods", nargs="+", default=["rtn", "4over6", "mse"], help="scale methods to compare")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="calibration sampling seeds")
    ap.add_argument(
        "--mixes", nargs="+", default=["experts"], help="--quantize values, e.g. experts experts,shared"
    )
    ap.add_argument("--limit", type=int, default=16384, help="held-out tokens per eval")
    ap.add_argument("--seq-len", type=int, default=512, help="tokens per eval window")
    ap.add_argument("--num-samples", type=int, default=128, help="calibration sequences")
    ap.add_argument("--device", default="cpu", help="device for calibration and eval")
    args = ap.parse_args()

    from fp4moe.eval.quality import evaluate
    from fp4moe.quantize.pipeline import QuantizeOptions, quantize

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        base = evaluate(
            args.reference, args.reference, seq_len=args.seq_len, limit=args.limit, device=args.device
        )
        for mix in args.mixes:
            for method, seed in [(m, s) for m in args.methods for s in args.seeds]:
                dst = Path(tmp) / f"{mix}-{method}-{seed}"
                quantize(
                    args.reference,
                    dst,
                    QuantizeOptions(
                        scale_method=method,
                        quantize_extra=mix,
                        seed=seed,
                        num_samples=args.num_samples,
                        device=args.device,
                        overwrite=True,
                    ),
                )
                r = evaluate(dst, args.reference, seq_len=args.seq_len, limit=args.limit, device=args.device)
                rows.append(dict(mix=mix, method=method, seed=seed, **asdict(r)))
                print(
                    f"{mix} {method} seed {seed}: KL {r.kl_mean:.5f}, ppl {r.model_scores.perplexity:.4f}",
                    flush=True,
                )
    Path(args.out).write_text(json.dumps(dict(bf16=asdict(base), runs=rows), indent=2) + "\n")
    print("\n| model | perplexity | KL mean (± over seeds) | KL p99 | top-1 agreement | MTP acceptance |")
    print("|---|---|---|---|---|---|")
    acc = base.reference_scores.mtp_acceptance
    print(
        f"| bf16 | {base.reference_scores.perplexity:.4f} | 0 | 0 | 100% | {'-' if acc is None else f'{acc:.1%}'} |"
    )
    for mix, method in [(x, m) for x in args.mixes for m in args.methods]:
        rs = [r for r in rows if r["method"] == method and r["mix"] == mix]

        def mean(key, rs=rs):
            return statistics.mean(_get(r, key) for r in rs)

        spread = statistics.pstdev([r["kl_mean"] for r in rs])
        acc = rs[0]["model_scores"]["mtp_acceptance"]
        acc_s = "-" if acc is None else f"{mean('model_scores.mtp_acceptance'):.1%}"
        print(
            f"| NVFP4 {mix} / {method} | {mean('model_scores.perplexity'):.4f} | {mean('kl_mean'):.5f} ± {spread:.5f} | "
            f"{mean('kl_p99'):.5f} | {mean('top1_agreement'):.2%} | {acc_s} |"
        )


def _get(row: dict, key: str):
    for part in key.split("."):
        row = row[part]
    return row


if __name__ == "__main__":
    main()
