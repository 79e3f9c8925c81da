"""BENCHMARKS.md's "Current figures", README.md's headline block and benchmarks/results/INDEX.md, built from the
result files that ``benchmarks/figures.toml`` names (which file and JSON path gives which figure).

    python benchmarks/report.py            # print the generated section
    python benchmarks/report.py --write    # rewrite the three generated blocks in place
    python benchmarks/report.py --check    # exit 1 when a generated block differs from what the files say (CI)
    python benchmarks/report.py --stale    # the figures measured before the last change to the code they measure

Every figure is quoted as the median of its runs with the spread beside it where the file keeps the runs ("1
run" or "median of N, spread not recorded" where it does not), with the commit, date and device it was measured
on, and each share of a roofline over both denominators: the one measured in the same run and the datasheet's.
A figure whose code (``[code]`` in the manifest) changed in git after its commit is marked "code changed since".
Needs git history for that (a full clone); without it, --stale says so and --check compares the rest."""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MANIFEST = ROOT / "benchmarks" / "figures.toml"
BENCHMARKS_MD = ROOT / "BENCHMARKS.md"
README_MD = ROOT / "README.md"
INDEX_MD = RESULTS / "INDEX.md"
BEGIN, END = "<!-- report:begin -->", "<!-- report:end -->"
README_BEGIN, README_END = "<!-- figures:begin -->", "<!-- figures:end -->"
STALE_MARK = ", code changed since"
DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
COMMIT = re.compile(
    r"\d{4}-\d{2}-\d{2}.*-([0-9a-f]{7,40})\.[a-z.]+$"
)  # <kind>-<device>-<date>[-...]-<commit>.json


class ManifestError(Exception):
    pass


# ---- selecting values from a result file ------------------------------------------------------------------


def _matches(item, conditions: dict[str, str]) -> bool:
    if not isinstance(item, dict):
        return False
    for k, v in conditions.items():
        if k.endswith("?"):  # key?=value: equal, or the key absent (files from before the option existed)
            k = k[:-1]
            if k not in item:
                continue
        if k not in item:
            return False
        x = item[k]
        if (x if isinstance(x, str) else json.dumps(x)) != v:
            return False
    return True


def select(data, selector: str):
    """The value at ``selector`` ("a/b[k=v,k2=v2]/c"); returns (value, the dict that holds it, its key)."""
    node, parent, key = data, None, None
    for part in selector.split("/"):
        m = re.fullmatch(r"([^\[\]]+)(?:\[([^\]]*)\])?", part)
        if not m:
            raise ManifestError(f"bad selector part {part!r} in {selector!r}")
        names, cond = m.groups()
        # a|b: the first of the keys the file has (a run's mode renamed since)
        name = next((n for n in names.split("|") if isinstance(node, dict) and n in node), None)
        if name is None:
            raise ManifestError(f"{selector!r}: no key {names!r}")
        parent, key, node = node, name, node[name]
        if cond is not None:
            conditions = dict(c.split("=", 1) for c in cond.split(",") if c)
            hits = [x for x in node if _matches(x, conditions)] if isinstance(node, list) else []
            if len(hits) != 1:
                raise ManifestError(f"{selector!r}: [{cond}] matches {len(hits)} elements, not one")
            node, parent, key = hits[0], None, None
    return node, parent, key


def runs_beside(parent: dict | None, key: str | None) -> list[float] | None:
    """The per-run values a file keeps beside a median: ``<key>_runs`` or ``per_run/<key less _median>``."""
    if parent is None or key is None:
        return None
    runs = parent.get(f"{key}_runs")
    if runs is None and isinstance(parent.get("per_run"), dict):
        runs = parent["per_run"].get(key.removesuffix("_median"))
    if isinstance(runs, list) and runs and all(isinstance(x, int | float) for x in runs):
        return [float(x) for x in runs]
    return None


def recorded_runs(parent: dict | None) -> int | None:
    """How many runs a recorded median is of, where the row says: ``runs`` (long_context.py's prefill rows,
    quantize.py's medians) or a served row's requests over its concurrency (``--runs`` rounds of it)."""
    if not parent:
        return None
    if isinstance(parent.get("runs"), int) and not isinstance(parent.get("runs"), bool):
        return parent["runs"]
    if isinstance(parent.get("requests"), int) and parent.get("concurrency"):
        return parent["requests"] // parent["concurrency"]
    return None


# ---- figures --------------------------------------------------------------------------------------------------


@dataclass
class Figure:
    spec: dict
    value: float
    runs: list[float] | None
    run_count: int
    share: float | None
    datasheet_share: float | None
    measured_denominator: float | None
    extras: list[str]
    commit: str | None
    date: str | None
    device: str | None
    stale: str | None = None  # None: current or unknown; else the commits that changed its code since
    notes: list[str] = field(default_factory=list)

    @property
    def id(self) -> str:
        return self.spec["id"]


def _num(v, spec: dict, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ManifestError(f"{spec['id']}: {what} is {v!r}, not a number")
    return float(v)


def _transform(v: float, spec: dict) -> float:
    if "reciprocal" in spec:
        v = spec["reciprocal"] / v
    return v * spec.get("scale", 1.0)


def load_figure(spec: dict, manifest: dict) -> Figure:
    path = RESULTS / spec["file"]
    if not path.exists():
        raise ManifestError(f"{spec['id']}: {path.relative_to(ROOT)} does not exist")
    data = json.loads(path.read_text())
    prov = data.get("provenance") or {}
    raw, parent, key = select(data, spec["value"])
    value = _num(raw, spec, "value")
    runs = runs_beside(parent, key)
    if "divide" in spec:
        den, dparent, dkey = select(data, spec["divide"])
        value /= _num(den, spec, "divide")
        druns = runs_beside(dparent, dkey)
        runs = [a / b for a, b in zip(runs, druns, strict=True)] if runs and druns else None
    if runs:
        value = statistics.median(runs)
    value = _transform(value, spec)
    runs = [_transform(x, spec) for x in runs] if runs else None
    run_count = (
        len(runs) if runs else int(recorded_runs(parent) or prov.get("repeats") or spec.get("runs") or 1)
    )
    share = datasheet = measured = None
    if "share" in spec:
        s, sparent, skey = select(data, spec["share"])
        share = _num(s, spec, "share")
        sruns = runs_beside(sparent, skey)
        share = statistics.median(sruns) if sruns else share
        den = manifest["denominators"][spec["denominator"]]
        measured = data.get(den["measured_key"])
        if isinstance(measured, int | float):
            datasheet = share * measured / den["datasheet"]
    extras = []
    for x in spec.get("extras", []):
        v, eparent, ekey = select(data, x["select"])
        if isinstance(v, int | float) and not isinstance(v, bool):
            eruns = runs_beside(eparent, ekey)
            v = _transform(statistics.median(eruns) if eruns else float(v), x)
            text = x.get("fmt", "{:,.0f}").format(v)
        else:
            text = json.dumps(v)
        extras.append(f"{x['label']} {text}")
    m, d = COMMIT.search(path.name), DATE.search(path.name)
    commit = prov.get("commit") or spec.get("commit") or (m and m[1])
    if prov.get("dirty"):
        commit = f"{commit}-dirty"
    date = (prov.get("date") or "")[:10] or spec.get("date") or data.get("date") or (d and d[0])
    dev = prov.get("device", {}).get("name") if isinstance(prov.get("device"), dict) else None
    dev = dev or (data.get("device") if isinstance(data.get("device"), str) else None)
    return Figure(spec, value, runs, run_count, share, datasheet, measured, extras, commit, date, dev)


def load_manifest(path: Path = MANIFEST) -> dict:
    manifest = tomllib.loads(path.read_text())
    ids = [f["id"] for f in manifest.get("figure", [])]
    if len(ids) != len(set(ids)):
        raise ManifestError("figure ids repeat")
    for f in manifest["figure"]:
        for k in ("id", "section", "label", "file", "value", "code"):
            if k not in f:
                raise ManifestError(f"figure {f.get('id', '?')}: no {k!r}")
        if f["code"] not in manifest["code"]:
            raise ManifestError(f"{f['id']}: code {f['code']!r} is not in [code]")
    return manifest


# ---- staleness (git) ------------------------------------------------------------------------------------------


def git(*args: str) -> str | None:
    try:
        r = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def git_available() -> bool:
    """A clone with its whole history (a shallow one cannot tell when code last changed)."""
    return git("rev-parse", "--verify", "-q", "HEAD") is not None and git(
        "rev-parse", "--is-shallow-repository"
    ) in ("false", None)


def mark_stale(figures: list[Figure], manifest: dict) -> None:
    """Set ``stale`` (how many commits changed the figure's code after its commit, and the first) or a note
    when its commit is not in this clone's history."""
    for f in figures:
        commit = (f.commit or "").removesuffix("-dirty")
        if not commit or git("cat-file", "-e", f"{commit}^{{commit}}") is None:
            f.notes.append("commit not in this clone's history")
            continue
        paths = manifest["code"][f.spec["code"]]
        changes = (git("log", "--format=%h", f"{commit}..HEAD", "--", *paths) or "").split()
        if changes:  # the first change after the measurement, and how many since
            f.stale = f"{len(changes)} commit{'s' * (len(changes) > 1)}, the first {changes[-1]}"


# ---- rendering ------------------------------------------------------------------------------------------------


def fmt_value(f: Figure) -> str:
    text = f.spec.get("fmt", "{:,.0f}").format(f.value)
    unit = f.spec.get("unit", "")
    return f"{text} {unit}".strip() if unit and unit not in text else text


def fmt_runs(f: Figure) -> str:
    fmt = f.spec.get("fmt", "{:,.0f}")
    if f.runs and len(f.runs) >= 3:
        return f"median of {len(f.runs)}, {fmt.format(min(f.runs))}–{fmt.format(max(f.runs))}"
    if f.runs and len(f.runs) == 2:
        return f"2 runs: {fmt.format(f.runs[0])}, {fmt.format(f.runs[1])}"
    if f.run_count > 1:
        return f"median of {f.run_count}, spread not recorded"
    return "1 run"


def fmt_share(f: Figure, manifest: dict) -> str:
    if f.share is None:
        return ""
    den = manifest["denominators"][f.spec["denominator"]]
    text = f"{f.share:.1%} of measured"
    if f.measured_denominator:
        text += (
            f" {f.measured_denominator * den['scale']:,.{2 if den['unit'] == 'TB/s' else 0}f} {den['unit']}"
        )
    if f.datasheet_share is not None:
        text += f"; {f.datasheet_share:.1%} of datasheet {den['datasheet'] * den['scale']:g} {den['unit']}"
    return text


def fmt_measured(f: Figure) -> str:
    text = f"{f.commit or 'commit unknown'}, {f.date or 'date unknown'}"
    if f.device and f.device != "NVIDIA H200":
        text += f", {f.device}"
    if f.stale:
        text = f"measured at {text}{STALE_MARK}"  # which commit changed it: --stale (kept out: it moves)
    return text


def acceptance_rows(manifest: dict, by_id: dict[str, Figure]) -> list[str]:
    """What a k = 2 round must carry to reach a peer's time a token: the round's measured cost (served: tokens
    a round ÷ tok/s; or a timed round read from the file), the tokens a round that cost needs, and the
    per-position acceptance a (1 + a + a² tokens a round) and drafts-accepted rate ((a + a²) / 2) giving them."""
    out = []
    for spec in manifest.get("acceptance", []):
        f = by_id[spec["ours"]]
        data = json.loads((RESULTS / f.spec["file"]).read_text())
        if "tokens_per_round" in spec:
            tokens = float(select(data, spec["tokens_per_round"])[0])
            round_ms = tokens / f.value * 1e3
            how = (
                f"a served round at this shape ({f.spec['label']}: {tokens:.2f} tokens a round at {f.value:,.1f} "
                f"tok/s, so **{round_ms:.2f} ms a round**, measured at {f.commit})"
            )
        else:
            round_ms = float(select(data, spec["round"])[0]) * spec.get("scale", 1.0)
            how = f"{spec['what']} (**{round_ms:.2f} ms**, measured at {f.commit})"
        need = round_ms / spec["target_ms"]
        a = 0.0 if need <= 1 else (-1 + math.sqrt(4 * need - 3)) / 2
        out.append(
            f"- To match {spec['peer']} with k = 2, {how} must carry **{need:.2f} tokens**: a per-position draft "
            f"acceptance of **{a:.0%}** (1 + a + a² tokens a round), i.e. **{(a + a * a) / 2:.0%} of drafted "
            f"tokens accepted**."
        )
    if out:
        out.append(
            "- Both assume a round costs the same whatever is accepted (the engine's rounds do: `spec_decode.py "
            "--full-size` times them by accepted count) and say nothing of the acceptance a head reaches on real "
            "text: ours has been measured only on random weights, with acceptance forced."
        )
    return out


def render_section(figures: list[Figure], manifest: dict) -> str:
    by_id = {f.id: f for f in figures}
    lines = [
        "## Current figures",
        "",
        "Generated by `python benchmarks/report.py --write` from `benchmarks/figures.toml` and the result files it",
        "names (do not edit between the markers: `report.py --check` fails in CI when this differs from the files).",
        "Every figure: the median of its runs and their spread where the file keeps them, else how many runs the",
        "recorded figure is of; the commit and date it was measured on (H200 unless named); "
        '"code changed since" where',
        "the code it measures changed in git after that commit (`report.py --stale`).",
        "",
        "Denominators:",
    ]
    for name, den in manifest["denominators"].items():
        lines.append(f"- {name}: measured {den['what']}; datasheet: {den['datasheet_what']}.")
    section = None
    for f in figures:
        if f.spec["section"] != section:
            section = f.spec["section"]
            lines += [
                "",
                f"### {section}",
                "",
                "| figure | value | runs | share | also | measured at | file |",
            ]
            lines.append("|---|---|---|---|---|---|---|")
        lines.append(
            f"| {f.spec['label']} | {fmt_value(f)} | {fmt_runs(f)} | {fmt_share(f, manifest)} | "
            f"{'; '.join(f.extras)} | {fmt_measured(f)} | `{f.spec['file']}` |"
        )
    if manifest.get("comparison"):
        lines += [
            "",
            "### Beside peers' figures",
            "",
            "A peer's figure is shown only with every difference in the work named; none of these is like for like.",
            "",
            "| ours | value | peer | what differs |",
            "|---|---|---|---|",
        ]
        for c in manifest["comparison"]:
            f = by_id[c["ours"]]
            also = f" ({'; '.join(f.extras)})" if f.extras else ""
            peer = c["peer"]
            for v in c.get("values", []):  # figures of the peer (or ours) read from result files
                x = float(select(json.loads((RESULTS / v["file"]).read_text()), v["select"])[0])
                peer += f"; {v['label']} {v.get('fmt', '{:,.0f}').format(x)} (`{v['file']}`)"
            lines.append(
                f"| {f.spec['section'].split(' (')[0].split(':')[0]}: {f.spec['label']} | {fmt_value(f)}{also}, "
                f"{fmt_measured(f)} | {peer} | {'; '.join(c['differences'])} |"
            )
        lines += [""] + acceptance_rows(manifest, by_id)
    return "\n".join(lines) + "\n"


def render_readme(figures: list[Figure], manifest: dict) -> str:
    lines = [
        "| figure (one H200, random weights) | value, runs | share of roofline | measured at |",
        "|---|---|---|---|",
    ]
    for f in figures:
        if f.spec.get("readme"):
            also = f" ({'; '.join(f.extras)})" if f.extras else ""
            lines.append(
                f"| {f.spec.get('readme_label') or f.spec['section'].split(' (')[0] + ': ' + f.spec['label']} | "
                f"{fmt_value(f)}{also}, {fmt_runs(f)} | "
                f"{fmt_share(f, manifest)} | {fmt_measured(f)} |"
            )
    lines.append("")
    lines.append(
        "Generated from `benchmarks/results/` by `benchmarks/report.py`; denominators, spreads and every"
    )
    lines.append("other figure in [BENCHMARKS.md](BENCHMARKS.md).")
    return "\n".join(lines) + "\n"


KINDS = [  # file name prefix -> what it is (the index's second column)
    ("gpu-test", "log of scripts/gpu_test.sh (the GPU tests)"),
    ("steps-", "the engine's step trace (FP4MOE_STEP_TRACE) of a served run, gzip"),
    ("serve-startup", "`benchmarks/serve.py`: server start-up and a first served row"),
    ("serve-side-by-side", "`benchmarks/vllm_side_by_side.py speed`: served sweep, one engine of the pair"),
    ("serve-", "`benchmarks/serve.py`: `fp4moe serve` + `fp4moe bench` rows"),
    ("long-context-prefill", "`benchmarks/long_context.py --prefill`: chunked prefill"),
    ("long-context-kernel", "`benchmarks/long_context.py`: the paged prefill attention kernel alone"),
    ("long-context", "`benchmarks/long_context.py`: decode by context and batch, prefill, capacity"),
    ("decode-", "`benchmarks/decode.py`: decode step, gate, prefill, kernel breakdown"),
    ("spec-profile", "`benchmarks/spec_decode.py --full-size --profile`: round and step by kernel"),
    ("spec-decode", "`benchmarks/spec_decode.py`: speculative rounds against plain steps"),
    ("first-round", "`benchmarks/first_round.py`: a fresh request's first speculative round"),
    ("startup-", "`benchmarks/startup.py`: engine start-up by phase"),
    ("prefill-profile", "`benchmarks/prefill_profile.py`: an 8K prefill's kernels"),
    ("prefill-batch", "`benchmarks/prefill_batch.py`: prompts prefilled together"),
    ("prefill-", "prefill timing (`benchmarks/decode.py` / `prefill_batch.py`)"),
    ("chunk-profile", "`benchmarks/chunk_profile.py`: chunks through the engine as served"),
    ("tune-", "a kernel sweep (`benchmarks/tune_*.py`)"),
    ("quality", "`benchmarks/quality.py`: KL on the trained reference model"),
    ("quantize", "`benchmarks/quantize.py`: quantize throughput and host memory"),
    ("dequant-modes", "dequantization modes of the expert kernels"),
    ("sdpa-backends", "`benchmarks/sdpa_backends.py`: attention backends"),
    ("launch-latency", "`benchmarks/launch_latency.py`: kernel launch latency"),
    ("profiler-effect", "timings with and without a profiler session"),
    ("test-suite", "the CPU test suite's durations"),
    ("vllm/", "`benchmarks/vllm_side_by_side.py`: our checkpoints in stock vLLM"),
    ("reference-model-cpu", "a reduced reference model trained on 2 CPU cores (`train_reference.py --cpu-spec`)"),
    ("reference-model", "a trained 30M reference model's config and training log"),
    ("budget-search", "`benchmarks/budget_search.py`: size vs KL vs accuracy of the format search and hand mixes"),
    ("gpu-train-tune", "a device call's log: the reference model's training and kernel sweeps"),
    ("kv-cache-quality", "`benchmarks/kv_cache_quality.py`: KL of an fp8 KV cache by scale rule"),
    ("engine-rss", "`benchmarks/engine_rss.py`: the engine's memory over a long mixed run"),
    ("image-load", "`benchmarks/image_load.py`: image requests under load, text latency, memory"),
    ("lm-eval", "`benchmarks/lm_eval_quality.py`: lm-eval accuracy and perplexity by recipe"),
]


def history_sections() -> list[tuple[str, str]]:
    """(heading, text) of each ``## `` section of benchmarks/HISTORY.md: the run that wrote a file."""
    history = ROOT / "benchmarks" / "HISTORY.md"
    if not history.exists():
        return []
    parts = re.split(r"^## (.+)$", history.read_text(), flags=re.M)
    return list(zip(parts[1::2], parts[2::2], strict=True))


def render_index(manifest: dict) -> str:
    sections = history_sections()
    used: dict[str, list[str]] = {}
    for f in manifest["figure"]:
        used.setdefault(f["file"], []).append(f["id"])
    lines = [
        "# benchmarks/results",
        "",
        "Generated by `python benchmarks/report.py --write`: every result file, what it is, and which current figure",
        "(`benchmarks/figures.toml` id) uses it. Files written since provenance stamping carry a `provenance`",
        "record (commit, command, device, versions, date, repeats); older ones carry what their names say (date,",
        "commit) and BENCHMARKS.md's history (`benchmarks/HISTORY.md`) gives their commands.",
        "",
        "| file | what | run (HISTORY.md section that cites it) | figures |",
        "|---|---|---|---|",
    ]
    for path in sorted(p for p in RESULTS.rglob("*") if p.is_file() and p.name != "INDEX.md"):
        rel = path.relative_to(RESULTS).as_posix()
        what = next((w for prefix, w in KINDS if rel.startswith(prefix)), "")
        if path.suffix == ".png":
            what = "plot of the JSON of the same name"
        elif path.suffix == ".log" and not rel.startswith("gpu-test"):
            what = f"log of the run; {what}"
        stem = path.name.split(".")[0]
        if re.search(r"\d{4}-\d{2}-\d{2}", path.parent.name):  # a dated run's folder: the run cites the folder
            stem = path.parent.name
        m = COMMIT.search(path.name)
        cited = next((h for h, text in sections if stem in text), "") or next(
            (f"{h} (cites its commit)" for h, text in sections if m and m[1] in text), ""
        )
        lines.append(f"| `{rel}` | {what} | {cited} | {', '.join(used.get(rel, []))} |")
    return "\n".join(lines) + "\n"


# ---- the files ------------------------------------------------------------------------------------------------


def replace_block(text: str, begin: str, end: str, body: str, name: str) -> str:
    if text.count(begin) != 1 or text.count(end) != 1:
        raise ManifestError(f"{name}: needs exactly one {begin} and one {end}")
    head, rest = text.split(begin)
    _, tail = rest.split(end)
    return f"{head}{begin}\n{body}{end}{tail}"


def block(text: str, begin: str, end: str) -> str:
    if text.count(begin) != 1 or text.count(end) != 1:
        return ""
    return text.split(begin)[1].split(end)[0]


def build(manifest: dict, git_ok: bool) -> tuple[list[Figure], str, str, str]:
    figures = [load_figure(spec, manifest) for spec in manifest["figure"]]
    if git_ok:
        mark_stale(figures, manifest)
    return (
        figures,
        render_section(figures, manifest),
        render_readme(figures, manifest),
        render_index(manifest),
    )


def _without_staleness(text: str) -> str:
    return re.sub(r"measured at ([^|]*?)" + re.escape(STALE_MARK), r"\1", text)


def check(manifest: dict, git_ok: bool) -> list[str]:
    """The generated blocks that differ from the files (empty: all current)."""
    _, section, readme, index = build(manifest, git_ok)
    have_section = block(BENCHMARKS_MD.read_text(), BEGIN, END).lstrip("\n")
    have_readme = block(README_MD.read_text(), README_BEGIN, README_END).lstrip("\n")
    have_index = INDEX_MD.read_text() if INDEX_MD.exists() else ""
    if not git_ok:  # staleness needs history: compare the rest
        have_section, section = _without_staleness(have_section), _without_staleness(section)
        have_readme, readme = _without_staleness(have_readme), _without_staleness(readme)
    bad = []
    for name, have, want in (
        ("BENCHMARKS.md (Current figures)", have_section, section),
        ("README.md (headline figures)", have_readme, readme),
        ("benchmarks/results/INDEX.md", have_index, index),
    ):
        if have != want:
            diff = next(
                (i, a, b)
                for i, (a, b) in enumerate(
                    zip(have.splitlines() + [""], want.splitlines() + [""], strict=False)
                )
                if a != b
            )
            bad.append(
                f"{name} differs from the result files at line {diff[0] + 1}:\n  has:  {diff[1]}\n  want: {diff[2]}"
            )
    return bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite the generated blocks in place")
    mode.add_argument(
        "--check", action="store_true", help="exit 1 if a generated block differs from the files"
    )
    mode.add_argument(
        "--stale",
        action="store_true",
        help="list the figures whose code changed after the commit they were measured on",
    )
    args = ap.parse_args(argv)
    try:
        manifest = load_manifest()
        git_ok = git_available()
        if args.check:
            bad = check(manifest, git_ok)
            if not git_ok:
                print("note: no git history here; staleness not checked", file=sys.stderr)
            for b in bad:
                print(b, file=sys.stderr)
            if bad:
                print("run: python benchmarks/report.py --write", file=sys.stderr)
                return 1
            print("generated figures match the result files")
            return 0
        if args.stale:
            if not git_ok:
                print("--stale needs git history (a clone with .git, not shallow): not available here",
                      file=sys.stderr)  # fmt: skip
                return 2
            figures, *_ = build(manifest, git_ok)
            for f in figures:
                if f.stale:
                    print(f"{f.id}: measured at {f.commit}; {f.spec['code']} code changed since ({f.stale})")
                elif f.notes:
                    print(f"{f.id}: {f.commit}: {'; '.join(f.notes)}")
            n = sum(bool(f.stale) for f in figures)
            print(f"{n} of {len(figures)} figures stale", file=sys.stderr)
            return 0
        figures, section, readme, index = build(manifest, git_ok)
        if args.write:
            if not git_ok:
                print("warning: no git history here: no figure marked stale", file=sys.stderr)
            BENCHMARKS_MD.write_text(
                replace_block(BENCHMARKS_MD.read_text(), BEGIN, END, section, "BENCHMARKS.md")
            )
            README_MD.write_text(
                replace_block(README_MD.read_text(), README_BEGIN, README_END, readme, "README.md")
            )
            INDEX_MD.write_text(index)
            print(f"wrote {len(figures)} figures")
            return 0
        print(section, end="")
        return 0
    except ManifestError as e:
        print(f"report: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
