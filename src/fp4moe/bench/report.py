"""Benchmark output: a markdown table (like the reference card's concurrency table), JSON, a PNG plot, each
with what was measured (model, server, settings, version, date) and warnings where a run is too short to
mean much."""

from __future__ import annotations

import json
from pathlib import Path

COLUMNS = [
    ("pp", "pp", "{:d}"),
    ("prompt_tokens", "prompt tok", "{:.1f}"),  # what the server counted per request (pp is what was asked)
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


# below these a figure says more about timer and scheduling noise than about the server
MIN_DECODE_TOKENS = 16  # tokens after the first: per-request decode tok/s is (tg - 1) / (e2e - TTFT)
MIN_E2E_S = 0.5
MIN_RUNS = 3


def warnings(rows: list[dict], runs: int) -> list[str]:
    """What makes these figures weak: too few tokens or seconds a request, too few runs for a median, a
    prompt the server counted far from the pp asked for (--chars-per-token)."""
    found = []
    short = sorted({r["tg"] for r in rows if r["tg"] - 1 < MIN_DECODE_TOKENS})
    if short:
        found.append(
            f"tg {', '.join(map(str, short))}: fewer than {MIN_DECODE_TOKENS} decode tokens a request, so "
            "per-request and aggregate tok/s are mostly timer and scheduling noise; use --tg 128 or more"
        )
    quick = [r for r in rows if r["requests"] and r["e2e_s_p50"] < MIN_E2E_S]
    if quick:
        found.append(
            f"{len(quick)} setting(s) finished in under {MIN_E2E_S} s a request (median): too short to time "
            "reliably; raise --tg"
        )
    if runs < MIN_RUNS:
        found.append(f"--runs {runs}: medians of fewer than {MIN_RUNS} rounds show no spread; use --runs 3 or more")
    off = sorted(
        {(r["pp"], r["depth"], r["prompt_tokens"]) for r in rows if r["requests"]
         and abs(r["prompt_tokens"] - (r["pp"] + r["depth"])) > 0.25 * (r["pp"] + r["depth"])}
    )  # fmt: skip
    for pp, depth, got in off:
        found.append(
            f"pp {pp}{f' at depth {depth}' if depth else ''}: the server counted {got:g} prompt tokens a "
            "request (tokenizer and template); set --chars-per-token to match, or read the 'prompt tok' column"
        )
    return found


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


def plot(rows: list[dict], path: Path, title: str = "") -> None:
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
    levels = sorted({r["concurrency"] for r in rows})
    for ax in (ax1, ax2):
        ax.set_xticks(levels, [str(c) for c in levels])  # the concurrencies measured, not 1.5 or 2.5
        ax.minorticks_off()
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def describe(meta: dict) -> str:
    """One line of what was measured, for the table and the plot."""
    server = meta.get("server", {})
    version = f", server {server['version']}" if server.get("version") else ""
    return (
        f"model {meta.get('model')} at {server.get('base_url')}{version}; fp4moe {meta.get('fp4moe')} bench, "
        f"{meta.get('date')}"
    )


def write_outputs(
    rows: list[dict], raw: list[dict], out_dir: Path, name: str = "bench", meta: dict | None = None
) -> dict[str, Path]:
    """bench.md (what was measured, the table, warnings), bench.json (the same and every round), bench.png;
    each written to a temporary name and renamed."""
    meta = meta or {}
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "markdown": out_dir / f"{name}.md",
        "json": out_dir / f"{name}.json",
        "png": out_dir / f"{name}.png",
    }
    notes = meta.get("warnings", [])
    head = f"{describe(meta)}\n\n" if meta else ""
    tail = "".join(f"\n- warning: {w}" for w in notes)
    _write(paths["markdown"], head + markdown(rows) + ("\n" + tail if tail else "") + "\n")
    _write(paths["json"], json.dumps({**meta, "summary": rows, "rounds": raw}, indent=2) + "\n")
    tmp = paths["png"].with_name(f".{paths['png'].stem}.tmp.png")
    plot(rows, tmp, describe(meta) if meta else "")
    tmp.replace(paths["png"])
    return paths


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
