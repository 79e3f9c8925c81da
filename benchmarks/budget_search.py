"""Size against quality for the format search (``quantize --budget``) beside the hand mixes, on a trained
reference model: the default (NVFP4 experts, the rest bf16), the FP8 mix, NVFP4 beyond the experts, and
searched builds at three KL budgets and at the FP8 mix's size -- each evaluated with ``fp4moe eval`` on
disjoint slices of the held-out text (KL mean ± its standard error over slices, top-1 agreement, perplexity)
and, with lm-eval installed, ``lm_eval_quality.py``'s held-out next-line task through our server (accuracy ±
lm-eval's stderr). For the searched builds the predictor's KL (the sum of the per-part KLs) is printed
beside the KL measured in the quantize pass on the same held-out calibration tokens.

    python benchmarks/budget_search.py .models/reference --out budget-search.json
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from lm_eval_quality import _answer, write_tasks
from provenance import write_result
from quality import heldout_slices

HAND_MIXES = [  # (name, --quantize)
    ("default (NVFP4 experts, rest bf16)", ()),
    ("FP8 mix (attention, deltanet, shared FP8)", ("attention:fp8", "deltanet:fp8", "shared:fp8")),
    ("NVFP4 beyond the experts (attention, deltanet, shared)", ("attention", "deltanet", "shared")),
]
FRACTIONS = (0.15, 0.4, 0.7)  # budgets: floor + f x (all-NVFP4's predicted KL - floor)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reference", help="the bf16 reference checkpoint (scripts/train_reference.py)")
    ap.add_argument("--out", default="budget-search.json", help="JSON results")
    ap.add_argument(
        "--slices", type=int, default=4, help="disjoint parts of the held-out text (stderr over them)"
    )
    ap.add_argument("--limit", type=int, default=16384, help="held-out tokens per slice at most")
    ap.add_argument("--seq-len", type=int, default=512, help="tokens per eval and calibration window")
    ap.add_argument("--num-samples", type=int, default=128, help="calibration sequences")
    ap.add_argument(
        "--sensitivity-samples", type=int, default=8, help="held-out calibration windows of the search"
    )
    ap.add_argument("--items", type=int, default=200, help="lm-eval next-line items (0: no lm-eval)")
    ap.add_argument("--device", default="cpu", help="device for calibration and eval")
    args = ap.parse_args()

    from fp4moe.eval.quality import evaluate
    from fp4moe.quantize.options import QuantizeOptions
    from fp4moe.quantize.pipeline import quantize
    from fp4moe.quantize.search import SearchTarget
    from fp4moe.quantize.sensitivity import SensitivityTable

    texts = heldout_slices(args.slices)
    common = dict(num_samples=args.num_samples, seq_len=args.seq_len, device=args.device, overwrite=True,
                  progress=False, sensitivity_samples=args.sensitivity_samples)  # fmt: skip

    def run_eval(model) -> list[dict]:
        return [asdict(evaluate(model, args.reference, text=t, seq_len=args.seq_len, limit=args.limit,
                                device=args.device, progress=False)) for t in texts]  # fmt: skip

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tasks = None
        if args.items:
            tasks = tmp / "tasks"
            tasks.mkdir()
            write_tasks(tasks, args.items, 4, 0.0)

        def build(name: str, options) -> None:
            dst = tmp / f"m{len(rows)}"
            start = time.perf_counter()
            report = quantize(args.reference, dst, options)
            row = dict(name=name, bytes=sum(f.stat().st_size for f in dst.glob("*.safetensors")),
                       tensor_bytes=tensor_bytes(dst),
                       quantize_seconds=time.perf_counter() - start, search=report.search, slices=run_eval(dst),
                       lm_eval=score(dst, tasks, args) if tasks else None)  # fmt: skip
            rows.append(row)
            print(line(row), flush=True)
            if len(rows) == 1:  # the table measured by the first build, kept beside the result
                (tmp / "table.json").write_bytes((dst / "sensitivity.json").read_bytes())
                out = Path(args.out)
                for suffix in ("json", "png"):
                    data = (dst / f"sensitivity.{suffix}").read_bytes()
                    out.with_name(f"{out.stem}-sensitivity.{suffix}").write_bytes(data)

        base_lm = score(Path(args.reference), tasks, args) if tasks else None
        # the table, measured once: the search with no constraint that binds gives the all-NVFP4 assignment
        build("search, no binding budget (kl=1e9)", QuantizeOptions(**common, target=SearchTarget("kl", 1e9)))
        table = SensitivityTable.load(tmp / "table.json")
        for name, mix in HAND_MIXES:
            build(name, QuantizeOptions(**common, quantize_extra=mix))
            rows[-1]["predicted_kl"] = mix_prediction(table, mix)
        floor = sum(min(c.kl[f] for f in ("nvfp4", "nvfp4-gptq") if f in c.kl) for c in table.parts
                    if c.part == "experts")  # fmt: skip
        top = rows[0]["search"]["predicted_kl"]
        stored = dict(**common, sensitivity=str(tmp / "table.json"))
        for f in FRACTIONS:
            kl = floor + f * (top - floor)
            build(f"search --budget kl={kl:.4g}", QuantizeOptions(**stored, target=SearchTarget("kl", kl)))
        fp8_tensors = next(r for r in rows if r["name"].startswith("FP8 mix"))["tensor_bytes"]
        build(f"search --target-bytes {fp8_tensors} (the FP8 mix's size)",
              QuantizeOptions(**stored, target=SearchTarget("bytes", float(fp8_tensors))))  # fmt: skip
    equal = rows[-1], next(r for r in rows if r["name"].startswith("FP8 mix"))
    (a, se_a), (b, se_b) = _kl(equal[0]), _kl(equal[1])
    verdict = dict(
        searched_kl=a, searched_stderr=se_a, fp8_mix_kl=b, fp8_mix_stderr=se_b,
        searched_mb=equal[0]["bytes"] / 1e6, fp8_mix_mb=equal[1]["bytes"] / 1e6,
        beats=a + 2 * se_a < b - 2 * se_b, loses=a - 2 * se_a > b + 2 * se_b,
    )  # fmt: skip
    print(f"at the FP8 mix's size: searched {a:.5f} ± {se_a:.5f} vs FP8 mix {b:.5f} ± {se_b:.5f}: "
          + ("the search wins" if verdict["beats"] else "the search loses" if verdict["loses"] else "no difference beyond 2 stderr"))  # fmt: skip
    result = dict(reference=args.reference, equal_size=verdict, slices=args.slices, limit=args.limit, seq_len=args.seq_len,
                  num_samples=args.num_samples, sensitivity_samples=args.sensitivity_samples, items=args.items,
                  bf16_lm_eval=base_lm, bf16=run_eval(args.reference), rows=rows)  # fmt: skip
    write_result(args.out, result)
    print(table_md(result))


def mix_prediction(table, mix: tuple[str, ...]) -> float:
    """The first-order predictor's KL for a hand mix: its parts' KLs from the table, summed."""
    chosen = dict(o.partition(":")[::2] for o in mix)
    total = 0.0
    for c in table.parts:
        fmt = "nvfp4" if c.part == "experts" else (chosen[c.part] or "nvfp4") if c.part in chosen else "bf16"
        total += c.kl[fmt]
    return total


def tensor_bytes(path: Path) -> int:
    """The bytes of every tensor in a checkpoint's safetensors files (headers left out), as the search counts."""
    from fp4moe.formats.checkpoint import read_header

    return sum(i.num_bytes for f in path.glob("*.safetensors") for i in read_header(f).values())


def score(path: Path, tasks: Path, args) -> dict:
    from fp4moe.engine.front.config import EngineConfig
    from fp4moe.eval.harness import run_tasks
    from fp4moe.server.in_process import served

    config = EngineConfig(dtype="auto", device=args.device, max_model_len=args.seq_len)
    results = run_tasks(path, config, ["heldout_next_line"], str(tasks), log_samples=True, serve=served)
    docs = sorted(results["samples"]["heldout_next_line"], key=lambda d: d["doc_id"])
    mc = results["results"]["heldout_next_line"]
    return dict(acc=mc["acc,none"], acc_stderr=mc["acc_stderr,none"], answers=[_answer(d) for d in docs])


def _kl(row: dict) -> tuple[float, float]:
    kl = [s["kl_mean"] for s in row["slices"]]
    return statistics.mean(kl), statistics.stdev(kl) / len(kl) ** 0.5


def line(row: dict) -> str:
    kl, se = _kl(row)
    s = row["search"]
    pred = (
        ""
        if not s
        else f"; predicted {s['predicted_kl']:.5f}, measured (calib held-out) {s['measured_kl']:.5f}"
    )
    return f"{row['name']}: {row['bytes'] / 1e6:.3f} MB, eval KL {kl:.5f} ± {se:.5f}{pred}"


def table_md(result: dict) -> str:
    lines = [
        "| build | MB | KL(bf16‖model), held-out, mean ± stderr | top-1 agreement | perplexity | next-line acc ± stderr "
        "| predicted KL | measured KL (calibration held-out) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    ppl = statistics.mean(s["reference_scores"]["perplexity"] for s in result["bf16"])
    acc = result["bf16_lm_eval"]
    acc_s = "-" if acc is None else f"{acc['acc']:.4f} ± {acc['acc_stderr']:.4f}"
    lines.append(f"| bf16 | - | 0 | 100% | {ppl:.3f} | {acc_s} | - | - |")
    for r in result["rows"]:
        kl, se = _kl(r)
        s, lm = r["search"], r["lm_eval"]
        lines.append(
            f"| {r['name']} | {r['bytes'] / 1e6:.3f} | {kl:.5f} ± {se:.5f} | "
            f"{statistics.mean(x['top1_agreement'] for x in r['slices']):.2%} | "
            f"{statistics.mean(x['model_scores']['perplexity'] for x in r['slices']):.3f} | "
            + ("-" if lm is None else f"{lm['acc']:.4f} ± {lm['acc_stderr']:.4f}")
            + (
                f" | {s['predicted_kl']:.5f} | {s['measured_kl']:.5f} |"
                if s
                else f" | {r['predicted_kl']:.5f} | - |"
            )
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
