"""benchmarks/report.py: BENCHMARKS.md's current figures, README's headline block and results/INDEX.md are what
the result files say (the CI check), an edit to the generated text is caught, the selectors and the medians
and spreads they quote, staleness from git, and benchmarks/verify_gpu.sh's dry run (every command's options
exist in the script it runs)."""

from __future__ import annotations

import ast
import json
import re
import subprocess
from pathlib import Path

import pytest

from fixtures import load_script

ROOT = Path(__file__).resolve().parents[2]
report = load_script("benchmarks/report.py")
provenance = load_script("benchmarks/provenance.py")


def test_generated_blocks_match_the_result_files():
    assert report.check(report.load_manifest(), report.git_available()) == []
    assert report.main(["--check"]) == 0


def test_an_edited_figure_fails_the_check(tmp_path, monkeypatch):
    text = report.BENCHMARKS_MD.read_text()
    generated = report.block(text, report.BEGIN, report.END)
    row = next(line for line in generated.splitlines() if " tok/s |" in line)
    edited = row.replace(" tok/s |", "0 tok/s |", 1)  # a figure ten times what its file says
    assert edited != row
    bad = tmp_path / "BENCHMARKS.md"
    bad.write_text(text.replace(row, edited))
    monkeypatch.setattr(report, "BENCHMARKS_MD", bad)
    problems = report.check(report.load_manifest(), report.git_available())
    assert len(problems) == 1 and "BENCHMARKS.md" in problems[0]
    assert report.main(["--check"]) == 1


def test_a_result_file_missing_from_the_index_fails_the_check(tmp_path, monkeypatch):
    lines = report.INDEX_MD.read_text().splitlines(keepends=True)
    index = tmp_path / "INDEX.md"
    index.write_text("".join(x for x in lines if "`vllm/matrix.json`" not in x))
    monkeypatch.setattr(report, "INDEX_MD", index)
    (problem,) = report.check(report.load_manifest(), report.git_available())
    assert "INDEX.md" in problem and "vllm/matrix.json" in problem


def test_selectors():
    data = {
        "rows": [{"k": 0, "batch": 1, "x": 1.0}, {"k": 2, "batch": 1, "x": 2.0, "v": 0}, {"k": 2, "batch": 8}]
    }
    assert report.select(data, "rows[k=2,batch=1]/x")[0] == 2.0
    assert report.select(data, "rows[k=0,v?=0]/x")[0] == 1.0  # absent key: matches
    assert report.select({"a": {"0.8": 3}}, "a/0.8")[0] == 3
    assert (
        report.select({"off": 1, "old": 2}, "old|off")[0] == 2
        and report.select({"off": 1}, "old|off")[0] == 1
    )
    assert report.select({"m": [{"on": True, "s": 1}, {"on": False, "s": 2}]}, "m[on=true]/s")[0] == 1
    with pytest.raises(report.ManifestError, match="matches 2"):
        report.select(data, "rows[k=2]/x")
    with pytest.raises(report.ManifestError, match="no key"):
        report.select(data, "rows[k=0]/y")


def _figure(tmp_path, monkeypatch, data: dict, **spec):
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    (tmp_path / "r-h200-2026-12-01-1234567.json").write_text(json.dumps(data))
    spec = dict(id="x", section="s", label="l", file="r-h200-2026-12-01-1234567.json", code="engine") | spec
    return report.load_figure(spec, report.load_manifest())


def test_runs_give_the_median_and_spread(tmp_path, monkeypatch):
    row = {"pp": 512, "aggregate_tps_median": 99.0, "per_run": {"aggregate_tps": [10.0, 40.0, 20.0]}}
    f = _figure(
        tmp_path, monkeypatch, {"served": {"off": [row]}}, value="served/off[pp=512]/aggregate_tps_median"
    )
    assert f.value == 20.0 and report.fmt_runs(f) == "median of 3, 10–40"
    assert f.commit == "1234567" and f.date == "2026-12-01"  # from the name: no provenance
    row = {"b": 1, "tok_s": 5.0, "tok_s_runs": [4.0, 6.0]}
    f = _figure(tmp_path, monkeypatch, {"rows": [row]}, value="rows[b=1]/tok_s")
    assert report.fmt_runs(f) == "2 runs: 4, 6"
    f = _figure(tmp_path, monkeypatch, {"rows": [{"b": 1, "t": 5.0}]}, value="rows[b=1]/t", runs=3)
    assert report.fmt_runs(f) == "median of 3, spread not recorded"
    served = {"served": {"off": [{"concurrency": 16, "requests": 48, "aggregate_tps_median": 5.0}]}}
    f = _figure(
        tmp_path, monkeypatch, served, value="served/off[concurrency=16]/aggregate_tps_median", runs=9
    )
    assert report.fmt_runs(f) == "median of 3, spread not recorded"  # the row's own count: 48 requests / 16
    prov = {"commit": "abcdef0", "dirty": True, "date": "2027-01-02T03:04:05+00:00", "repeats": 1}
    f = _figure(tmp_path, monkeypatch, {"t": 4.0, "provenance": prov}, value="t", reciprocal=1000)
    assert f.value == 250.0 and report.fmt_runs(f) == "1 run"
    assert f.commit == "abcdef0-dirty" and f.date == "2027-01-02"  # provenance over the name


def test_shares_over_both_denominators(tmp_path, monkeypatch):
    data = {"copy_bandwidth": 4.2e12, "rows": [{"b": 1, "tok_s": 400.0, "pct": 0.5}]}
    f = _figure(
        tmp_path, monkeypatch, data, value="rows[b=1]/tok_s", share="rows[b=1]/pct", denominator="bandwidth"
    )
    assert f.datasheet_share == pytest.approx(0.5 * 4.2 / 4.8)
    assert (
        report.fmt_share(f, report.load_manifest())
        == "50.0% of measured 4.20 TB/s; 43.8% of datasheet 4.8 TB/s"
    )


def test_acceptance_to_match_a_peer():
    """1 + a + a² tokens a round at per-position acceptance a: the round's cost over the peer's time a token."""
    manifest = report.load_manifest()
    figures = {f.id: f for f in (report.load_figure(s, manifest) for s in manifest["figure"])}
    lines = [x for x in report.acceptance_rows(manifest, figures) if x.startswith("- To match")]
    assert len(lines) == len(manifest["acceptance"])
    for line in lines:
        round_ms = float(re.search(r"\*\*([\d.]+) ms( a round)?\*\*", line)[1])
        tokens = float(re.search(r"carry \*\*([\d.]+) tokens\*\*", line)[1])
        a = int(re.search(r"acceptance of \*\*(\d+)%\*\*", line)[1]) / 100
        assert tokens == pytest.approx(round_ms / 1.98, abs=0.01)
        assert 1 + a + a * a == pytest.approx(tokens, abs=0.02)


def test_staleness_from_git(monkeypatch):
    if not report.git_available() or report.git("rev-parse", "--is-shallow-repository") == "true":
        pytest.skip("needs the full git history")
    manifest = report.load_manifest()
    spec = next(s for s in manifest["figure"] if s["code"] == "engine")
    head = report.git("rev-parse", "--short=7", "HEAD")
    changed = report.git("log", "-2", "--format=%h", "--", *manifest["code"]["engine"]).split()[-1]
    figures = [report.load_figure(spec | {"commit": c}, manifest) for c in (head, changed, "0000000")]
    report.mark_stale(figures, manifest)
    assert figures[0].stale is None and figures[1].stale and figures[2].notes
    assert "code changed since" in report.fmt_measured(figures[1])


def test_stale_without_git_says_so(monkeypatch, capsys):
    monkeypatch.setattr(report, "git", lambda *a: None)
    assert report.main(["--stale"]) == 2
    assert "needs git history" in capsys.readouterr().err
    assert report.main(["--check"]) == 0  # the rest still checked


def test_provenance_falls_back_to_the_environment(monkeypatch, tmp_path):
    monkeypatch.setattr(provenance, "_git", lambda *a: None)
    monkeypatch.setenv("FP4MOE_COMMIT", "abc1234-dirty")
    monkeypatch.setattr(provenance, "_AT_START", provenance.commit())  # as taken when the run starts
    monkeypatch.setenv("FP4MOE_COMMIT", "fffffff")  # a commit made while it ran is not the one it measured
    path = provenance.write_result(tmp_path / "r.json", {"x": 1}, repeats=3)
    p = json.loads(path.read_text())["provenance"]
    assert p["commit"] == "abc1234" and p["dirty"] is True and p["source"] == "FP4MOE_COMMIT"
    assert p["repeats"] == 3 and set(p["versions"]) >= {"torch", "triton", "fla-core", "transformers"}
    assert {"name", "command", "date"} <= set(p["device"]) | set(p)


def _options(script: Path) -> set[str]:
    return {
        a.value
        for node in ast.walk(ast.parse(script.read_text()))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "add_argument"
        for a in node.args
        if isinstance(a, ast.Constant) and str(a.value).startswith("--")
    }


def test_verify_gpu_dry_run():
    out = subprocess.run(
        ["bash", "benchmarks/verify_gpu.sh", "--dry-run", "all"], cwd=ROOT, capture_output=True, text=True,
        env={"PATH": "/usr/bin:/bin", "FP4MOE_COMMIT": "abc1234"}, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert [x for x in out.stdout.splitlines() if x.startswith("== ")] == [
        "== kernels",
        "== kernels2",
        "== marked",
        "== runner",
        "== spec",
        "== server",
        "== engine",
        "== served",
    ]
    commands = [x[2:].split() for x in out.stdout.splitlines() if x.startswith("+ python3 benchmarks/")]
    assert {c[1] for c in commands} == {
        "benchmarks/long_context.py",
        "benchmarks/spec_decode.py",
        "benchmarks/serve.py",
    }
    for c in commands:
        unknown = {a for a in c[2:] if a.startswith("--")} - _options(ROOT / c[1])
        assert not unknown, f"{c[1]} has no {unknown}"
    assert (
        subprocess.run(
            ["bash", "benchmarks/verify_gpu.sh", "nonsense"], cwd=ROOT, capture_output=True
        ).returncode
        == 2
    )
