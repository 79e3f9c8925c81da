"""bench's report says what it measured: the prompt tokens the server counted, warnings where a run is too
short to mean much, integer concurrency ticks, and the model, server, version and date."""

import json

import matplotlib.pyplot as plt

from fp4moe.bench import report


def _row(**over):
    row = {"pp": 512, "tg": 128, "depth": 0, "concurrency": 1, "requests": 3, "errors": 0, "prompt_tokens": 515.0,
           "aggregate_tps_median": 100.0, "decode_tps_per_request_median": 100.0, "decode_steady_tps_median": None,
           "ttft_s_median": 0.05, "ttft_s_p90": 0.06, "ttft_content_s_median": 0.05, "prefill_tps_median": 9000.0,
           "e2e_s_p50": 1.3, "e2e_s_p99": 1.4}  # fmt: skip
    return {**row, **over}


def test_a_sound_run_has_no_warnings():
    assert report.warnings([_row(), _row(concurrency=4)], runs=3) == []


def test_short_runs_and_miscounted_prompts_are_warned():
    found = report.warnings([_row(pp=64, tg=4, prompt_tokens=129.5, e2e_s_p50=0.02)], runs=1)
    assert any(w.startswith("tg 4: fewer than 16 decode tokens a request") for w in found)
    assert any("finished in under 0.5 s a request" in w for w in found)
    assert any(w.startswith("--runs 1:") for w in found)
    assert any(w.startswith("pp 64: the server counted 129.5 prompt tokens a request") for w in found)


def test_table_shows_the_prompt_tokens_sent():
    table = report.markdown([_row(pp=64, prompt_tokens=129.5)])
    assert table.splitlines()[0].startswith("| pp | prompt tok | tg |")
    assert table.splitlines()[2].startswith("| 64 | 129.5 | 128 |")


def test_plot_ticks_are_the_concurrencies_and_the_title_says_what(tmp_path, monkeypatch):
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    rows = [_row(concurrency=c) for c in (1, 2, 3)]
    report.plot(rows, tmp_path / "p.png", "model m at http://x/v1; fp4moe 0.1.0 bench, 2026-12-05 13:00 UTC")
    (fig,) = figures
    for ax in fig.axes:
        assert list(ax.get_xticks()) == [1, 2, 3]
        assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "2", "3"]
    assert fig._suptitle.get_text().startswith("model m at http://x/v1")


def test_outputs_carry_the_metadata(tmp_path):
    meta = {"model": "m", "server": {"base_url": "http://x/v1", "version": "0.26.0"}, "fp4moe": "0.1.0",
            "date": "2026-12-05 13:00 UTC", "settings": {"pp": [512]}, "warnings": ["tg 4: short"]}  # fmt: skip
    paths = report.write_outputs([_row()], [], tmp_path, meta=meta)
    data = json.loads(paths["json"].read_text())
    assert data["model"] == "m" and data["server"]["version"] == "0.26.0" and data["warnings"] == ["tg 4: short"]
    md = paths["markdown"].read_text()
    assert md.startswith("model m at http://x/v1, server 0.26.0; fp4moe 0.1.0 bench, 2026-12-05 13:00 UTC")
    assert "- warning: tg 4: short" in md
    assert paths["png"].exists() and not list(tmp_path.glob(".*"))
