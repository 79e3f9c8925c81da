"""Plot benchmarks/decode.py results: decode tok/s per batch and context against each one's roofline.

python benchmarks/plot_decode.py benchmarks/results/decode-h200-2026-11-30.json out.png [more.json ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("first", help="a decode.py result (JSON)")
    p.add_argument("out", help="the image to write (PNG)")
    p.add_argument("more", nargs="*", help="more decode.py results drawn on the same axes")
    args = p.parse_args()
    first, out, more = args.first, args.out, args.more
    rows = []
    for path in [first, *more]:
        rows += [r for r in json.loads(Path(path).read_text())["decode"] if "roofline_tok_s" in r]
    seen, series = set(), {}
    for r in rows:
        key = (r["model"], r["kv"], r["context"], r["batch"])
        if key in seen:
            continue
        seen.add(key)
        series.setdefault((r["model"], r["kv"], r["context"]), []).append(r)
    fig, ax = plt.subplots(figsize=(8, 5))
    for (model, kv, ctx), rs in sorted(series.items()):
        rs.sort(key=lambda r: r["batch"])
        b = [r["batch"] for r in rs]
        line = ax.plot(b, [r["tok_s"] for r in rs], "o-", label=f"{model}, kv {kv}, ctx {ctx}")[0]
        ax.plot(b, [r["roofline_tok_s"] for r in rs], "--", color=line.get_color(), alpha=0.5)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch (sequences decoding together)")
    ax.set_ylabel("tokens/s (solid: measured; dashed: roofline)")
    ax.set_title("fp4moe decode on one H200, full-size Qwen3.5-35B-A3B shapes")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    main()
