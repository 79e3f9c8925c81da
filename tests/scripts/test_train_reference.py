"""The reference-model training script, as a smoke run: three steps of the tiny spec on the CPU write a
complete checkpoint (checksummed, with its log and curves) that our engine loads and fp4moe eval reads."""

import hashlib
import json

from fixtures import load_script
from fp4moe.eval.quality import evaluate


def _script():
    return load_script("scripts/train_reference.py")


def test_smoke_run_writes_a_checkpoint_our_engine_evaluates(tmp_path):
    out = tmp_path / "ref"
    args = [
        "--tiny",
        "--max-steps",
        "3",
        "--seq-len",
        "32",
        "--batch",
        "2",
        "--eval-every",
        "2",
        "--out",
        str(out),
    ]
    assert _script().main(args) == 0
    log = json.loads((out / "training_log.json").read_text())
    assert log["steps"] == 3 and log["curve"] and log["heldout"]["heldout_ppl"] > 1
    for line in (out / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split()
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == digest
    assert (out / "loss.png").stat().st_size > 0
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no temp dir left
    r = evaluate(out, out, seq_len=32, limit=64, progress=False)
    assert r.kl_mean == 0 and r.model_scores.mtp_acceptance is not None
