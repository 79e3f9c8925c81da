"""Benchmark output: a markdown table (like the reference card's concurrency table), JSON, a PNG plot."""

from __future__ import annotations

import json
from pathlib import Path

COLUMNS = [
    ("pp", "pp", "{:d}"),
    ("tg", "tg", "{:d}"),
    ("depth", "depth", "{:d}"),
    ("concurrency", "conc", "{:d}"),
    ("aggregate_tps_median", "aggregate tok/s", "{:.1f}"),
    ("decode_tps_per_request_median", "per-request tok/s", "{:.1f}"),
    ("decode_steady_tps_median", "steady decode tok/s", "{:.1f}"),
    ("ttft_s_median", "TTFT p50 (s)", "{:.3f}"),
    ("ttft_s_p90", "TTFT p90 (s)", "{:.3f}"),
    ("ttft_content_s_median", "first text p50 (s)", "{:.3f}"),
    ("prefill_tps_median", "prefill tok/s", "{:.0f}"),
    ("e2e_s_p50", "e2e p50 (s)", "{:.2f}"),
    ("e2e_s_p99", "e2e p99 (s)", "{:.2f}"),
    ("errors", "errors", "{:d}"),
]


def markdown(rows: list[dict]) -> str:
    cols = list(COLUMNS)
    if any("spec_acceptance_rate" in r for r in rows):
        cols += [
            ("spec_acceptance_rate", "spec accept", "{:.1%}"),
            ("spec_mean_acceptance_length", "accept len", "{:.2f}"),
        ]
    lines = ["| " + " | ".join(c[1] for c in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = []
        for key, _, fmt in cols:
            v = r.get(key)
            cells.append("-" if v is None else fmt.format(int(v) if fmt == "{:d}" else v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["pp"], r["tg"], r["depth"]), []).append(r)
    for (pp, tg, depth), rs in groups.items():
        rs = sorted(rs, key=lambda r: r["concurrency"])
        c = [r["concurrency"] for r in rs]
        label = f"pp{pp} tg{tg}" + (f" @{depth}" if depth else "")
        ax1.plot(c, [r["aggregate_tps_median"] for r in rs], "o-", label=f"aggregate, {label}")
        ax1.plot(c, [r["decode_tps_per_request_median"] for r in rs], "s--", label=f"per request, {label}")
        ax2.plot(c, [r["ttft_s_median"] for r in rs], "o-", label=label)
    ax1.set(xlabel="concurrent requests", ylabel="decode tok/s", title="Throughput vs concurrency")
    ax2.set(xlabel="concurrent requests", ylabel="seconds", title="Time to first token (median)")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(rows: list[dict], raw: list[dict], out_dir: Path, name: str = "bench") -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "markdown": out_dir / f"{name}.md",
        "json": out_dir / f"{name}.json",
        "png": out_dir / f"{name}.png",
    }
    paths["markdown"].write_text(markdown(rows) + "\n")
    paths["json"].write_text(json.dumps({"summary": rows, "rounds": raw}, indent=2) + "\n")
    plot(rows, paths["png"])
    return paths
