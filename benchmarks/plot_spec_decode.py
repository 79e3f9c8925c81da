"""Plot speculative decoding speedup vs acceptance rate from ``spec_decode.py --full-size`` results.

    python benchmarks/plot_spec_decode.py spec-full.json spec-full.png [--reference spec.json]

One panel per context length: expected speedup over plain decoding (k = 0) against the per-draft
acceptance rate, one line per (k, batch). With ``--reference`` (a run on the trained model) each measured
point (its real acceptance and speedup) is marked.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", help="JSON from spec_decode.py --full-size")
    ap.add_argument("out", help="image to write (.png)")
    ap.add_argument("--reference", help="JSON from spec_decode.py on a trained model: measured points")
    args = ap.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(Path(args.results).read_text())
    rows = [r for r in data["rows"] if r["k"] > 0]
    contexts = sorted({r["context"] for r in rows})
    fig, axes = plt.subplots(1, len(contexts), figsize=(6 * len(contexts), 4.5), squeeze=False, sharey=True)
    for ax, ctx in zip(axes[0], contexts, strict=True):
        for r in (r for r in rows if r["context"] == ctx):
            alphas = sorted(float(a) for a in r["speedup_at_alpha"])
            gains = [r["speedup_at_alpha"][str(a) if str(a) in r["speedup_at_alpha"] else a] for a in alphas]
            ax.plot(alphas, gains, marker="o", label=f"k={r['k']}, batch {r['batch']}")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_title(f"{data['device']}, full-size model, context {ctx}")
        ax.set_xlabel("per-draft acceptance rate")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("decode speedup over k = 0")
    if args.reference:
        ref = json.loads(Path(args.reference).read_text())
        ax = axes[0][0]
        for r in ref["rows"]:
            if r["k"] > 0:
                ax.scatter([r["acceptance"]], [r["speedup"]], marker="x", color="black")
                ax.annotate(f"trained k={r['k']} b={r['batch']}", (r["acceptance"], r["speedup"]), fontsize=7)
    axes[0][-1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
