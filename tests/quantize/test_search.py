"""``quantize --budget`` / ``--target-bytes`` / ``--target-bpw``: the knapsack against brute force, the search
on a tiny model keeping a part whose sensitivity is planted high in bf16, the first-order predictor against
the measured KL, the card's rebuild command reproducing the tensors, impossible targets as one-line errors,
and an interrupted run leaving nothing and resuming from its saved table."""

import itertools
import json
import shlex

import pytest
import torch

from fixtures import CALIB, load_all, rewrite_tensors
from fp4moe.cli import main
from fp4moe.cli.options import EXIT_ERROR
from fp4moe.models.tiny import TinySpec
from fp4moe.quantize import parts as P
from fp4moe.quantize import search_pass
from fp4moe.quantize.options import QuantizeOptions
from fp4moe.quantize.pipeline import quantize
from fp4moe.quantize.search import GRID, SearchTarget, _knapsack, search
from fp4moe.quantize.sensitivity import PartCost, SensitivityTable

PLANTED = "model.language_model.layers.1.mlp.shared_expert.down_proj.weight"


def _options(**kw) -> QuantizeOptions:
    return QuantizeOptions(**{**CALIB, "sensitivity_samples": 4, **kw})


def _table(path) -> SensitivityTable:
    return SensitivityTable.load(path / "sensitivity.json")


@pytest.fixture(scope="module")
def planted(checkpoints, tmp_path_factory):
    """The tiny model with layer 1's shared expert made sensitive: its down_proj gets one weight 1e7 times
    the largest, in a column whose input is always 0 (up_proj's row zeroed), so the bf16 model is unchanged
    in what it computes, but FP8's per-tensor scale and NVFP4's global scale are set by that weight and
    flush every other weight of the tensor to zero. Quantized once with a generous budget, which measures
    the table the tests then search on."""
    src = checkpoints.copy(checkpoints.bf16(), "planted")
    tensors = load_all(src)
    down = tensors[PLANTED].float()
    down[:, 0] = 1e7 * down.abs().max()
    tensors[PLANTED] = down.to(tensors[PLANTED].dtype)
    up = PLANTED.replace("down_proj", "up_proj")
    tensors[up] = tensors[up].clone()
    tensors[up][0] = 0
    rewrite_tensors(src, tensors)
    out = tmp_path_factory.mktemp("planted") / "q"
    report = quantize(src, out, _options(target=SearchTarget("kl", 100.0)))
    return src, out, report


def _brute_force(weights: list[list[float]], costs: list[list[float]], cap: float) -> float | None:
    """The least total cost of one choice per group with total weight <= cap, by trying every choice set."""
    best = None
    for combo in itertools.product(*(range(len(w)) for w in weights)):
        if sum(w[k] for w, k in zip(weights, combo, strict=True)) <= cap:
            cost = sum(c[k] for c, k in zip(costs, combo, strict=True))
            best = cost if best is None else min(best, cost)
    return best


def test_knapsack_matches_brute_force():
    """Random 6-part tables with 3 choices each: the grid DP meets the cap and costs no more than the exact
    optimum under a cap one grid step a part tighter (its rounding bound)."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(30):
        weights = torch.rand(6, 3, generator=gen).tolist()
        costs = torch.rand(6, 3, generator=gen).tolist()
        cap = float(torch.rand((), generator=gen)) * 3 + 0.3
        choice = _knapsack(weights, costs, cap)
        if _brute_force(weights, costs, cap) is None:
            assert choice is None
            continue
        assert sum(w[k] for w, k in zip(weights, choice, strict=True)) <= cap
        tighter = _brute_force(weights, costs, cap - 6 * cap / GRID)
        got = sum(c[k] for c, k in zip(costs, choice, strict=True))
        assert tighter is None or got <= tighter + 1e-12


def _synthetic_table(gen: torch.Generator) -> SensitivityTable:
    parts = []
    for layer in range(3):
        for part in ("experts", "shared", "deltanet"):
            kl = torch.rand(2, generator=gen).sort(descending=True).values.tolist()  # nvfp4 worse than fp8
            costs = {P.BF16: 0.0, P.FP8: kl[1], P.NVFP4: kl[0]}
            if part == "experts":  # NVFP4 only, as the search writes them
                costs = {P.NVFP4: kl[0]}
            parts.append(PartCost(layer, part, 1000, {P.BF16: 2000, P.FP8: 1008, P.NVFP4: 570}, costs))
    return SensitivityTable({}, 64, 100, parts)


def test_search_meets_every_target_and_is_optimal():
    """Synthetic tables: for budgets from the floor up, the predicted KL is within the budget and the bytes
    are the fewest any assignment within it has (brute force); byte targets likewise the least KL."""
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        table = _synthetic_table(gen)
        opts = [[f for f in P.WRITABLE[c.part] if f in c.kl] for c in table.parts]
        kls = [[c.kl[f] for f in o] for c, o in zip(table.parts, opts, strict=True)]
        sizes = [[float(c.bytes[f]) for f in o] for c, o in zip(table.parts, opts, strict=True)]
        floor = sum(min(k) for k in kls)
        for budget in (floor, floor + 0.05, floor + 0.3, floor + 1.0, 100.0):
            a = search(table, SearchTarget("kl", budget))
            assert a.predicted_kl <= budget * (1 + 1e-12)
            best = _brute_force(kls, sizes, budget - (budget - floor) * len(kls) / GRID)
            assert a.bytes - table.fixed_bytes <= best
        for target in (table.fixed_bytes + 9 * 570, table.fixed_bytes + 9 * 1200):
            a = search(table, SearchTarget("bytes", target))
            assert a.bytes <= target
            # the byte limit is exact; the KL within a grid step a part of the least KL meeting it
            best = _brute_force(sizes, kls, target - table.fixed_bytes)
            span = sum(max(k) - min(k) for k in kls)
            assert a.predicted_kl <= best + 9 * span / (GRID - 9) + 1e-12
        for bpw in (4.6, 6.0, 9.0):  # 9 parts of 1000 weights: B bits a weight is B x 9000 / 8 bytes
            a = search(table, SearchTarget("bpw", bpw))
            assert a.bits_per_weight <= bpw
            assert a.predicted_kl <= _brute_force(sizes, kls, bpw * 9000 / 8) + 9 * span / (GRID - 9) + 1e-12


def test_planted_sensitive_part_stays_bf16(planted):
    """With a budget that affords every other part in NVFP4 but not the planted one in any format, the
    search keeps exactly the planted part in bf16 and quantizes the rest to the fewest bytes."""
    _, out, _ = planted
    table = _table(out)
    cost = {(c.layer, c.part): c for c in table.parts}
    hot = cost[(1, "shared")]
    floor = sum(
        min(c.kl[f] for f in P.WRITABLE["experts"] if f in c.kl) for c in table.parts if c.part == "experts"
    )
    others = sum(c.kl[P.NVFP4] for c in table.parts if c.part != "experts" and c is not hot)
    # the planting worked: the hot part, in its cheapest rounding, costs more than all the others in NVFP4
    assert min(hot.kl[P.FP8], hot.kl[P.NVFP4]) > others > 0, (hot.kl, others)
    budget = floor + others + 0.5 * (min(hot.kl[P.FP8], hot.kl[P.NVFP4]) - others)
    chosen = search(table, SearchTarget("kl", budget)).formats
    assert chosen[(1, "shared")] == P.BF16
    assert all(f == P.NVFP4 for k, f in chosen.items() if k != (1, "shared")), chosen


def test_predictor_exact_on_one_layer_and_bounded_on_the_fixture(checkpoints, planted, tmp_path):
    """One decoder layer: the measured KL of the whole build is the predicted one (the same quantized weights
    run through the same layer in both passes). Four layers: the first-order sum over-predicts; on this
    fixture the measured/predicted ratio was 0.43-0.85 over budgets -- asserted within [0.3, 1.1]: a broken
    pass (a part not swapped in, KL to the wrong part, tokens miscounted) leaves the range."""
    one = checkpoints.bf16(spec=TinySpec(num_layers=1, with_mtp=False))
    quantize(one, tmp_path / "one", _options(target=SearchTarget("kl", 100.0)))
    floor = table_floor(_table(tmp_path / "one"))  # the routed experts alone in NVFP4
    only = _options(
        target=SearchTarget("kl", floor * (1 + 1e-9)), sensitivity=str(tmp_path / "one/sensitivity.json")
    )
    s = quantize(one, tmp_path / "experts-only", only).search
    assert {r["part"]: r["format"] for r in s["formats"]} == {
        "experts": "nvfp4",
        "shared": "bf16",
        "deltanet": "bf16",
    }
    assert s["measured_kl"] == pytest.approx(s["predicted_kl"], rel=1e-5)
    src, out, first = planted
    table = _table(out)
    for target in (first.search["predicted_kl"], (first.search["predicted_kl"] + table_floor(table)) / 2):
        r = quantize(src, tmp_path / f"b{target}", _options(target=SearchTarget("kl", target),
                                                            sensitivity=str(out / "sensitivity.json")))  # fmt: skip
        ratio = r.search["measured_kl"] / r.search["predicted_kl"]
        assert 0.3 <= ratio <= 1.1, (r.search["measured_kl"], r.search["predicted_kl"])


def table_floor(table) -> float:
    """The least predicted KL any writable assignment has."""
    return sum(min(c.kl[f] for f in P.WRITABLE[c.part] if f in c.kl) for c in table.parts)


def test_card_rebuild_command_reproduces_the_tensors(planted, tmp_path, capsys):
    """The command in the card, run from the output's folder with SRC beside it, writes the same tensors
    bit for bit (it reads the stored table, so the same assignment), the same config and recipe."""
    src, out, _ = planted
    card = (out / "README.md").read_text()
    assert "## Formats chosen per layer (search)" in card and "Predicted KL" in card and "measured KL" in card
    assert "| 1 | nvfp4 |" in card  # the per-layer table
    line = next(x for x in card.splitlines() if x.startswith("fp4moe quantize "))
    argv = shlex.split(line)[1:]
    assert argv[1:3] == [src.name, out.name] and "--budget" in argv and "--sensitivity" in argv
    workdir = tmp_path / "rebuild"
    workdir.mkdir()
    (workdir / src.name).symlink_to(src)
    (workdir / out.name).symlink_to(out)
    argv[2] = str(tmp_path / "again")
    argv = [a if not a.startswith(out.name + "/") else str(workdir / a) for a in argv]
    argv[1] = str(workdir / src.name)
    assert main([*argv, "--no-progress"]) == 0
    assert _same_bytes(load_all(out), load_all(tmp_path / "again"))
    for f in ("config.json", "hf_quant_config.json"):
        assert json.loads((out / f).read_text()) == json.loads((tmp_path / "again" / f).read_text())


def test_card_command_carries_the_options_that_change_the_bytes(planted):
    """The test's calibration settings and --sensitivity-samples (which picks the held-out tail, so the
    calibration windows too) are in the command."""
    line = next(
        x for x in (planted[1] / "README.md").read_text().splitlines() if x.startswith("fp4moe quantize")
    )
    assert "--sensitivity-samples 4" in line and "--num-samples 8" in line and "--seq-len 64" in line


def _same_bytes(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[n].reshape(-1).view(torch.uint8), b[n].reshape(-1).view(torch.uint8)) for n in a
    )


def _fails(capsys, argv) -> str:
    capsys.readouterr()
    assert main(argv) == EXIT_ERROR
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fp4moe quantize: error: "), err
    return err[0]


def test_impossible_targets_name_the_nearest_feasible_one(planted, tmp_path, capsys):
    src, out, _ = planted
    table = out / "sensitivity.json"
    base = ["quantize", str(src), str(tmp_path / "x"), "--no-progress", "--num-samples", "8", "--seq-len", "64",
            "--calib-dtype", "float32", "--sensitivity-samples", "4", "--sensitivity", str(table)]  # fmt: skip
    line = _fails(capsys, [*base, "--budget", "kl=1e-9"])
    assert "below the least predicted KL" in line
    feasible = line.rsplit("kl>=", 1)[1]
    line = _fails(capsys, [*base, "--target-bytes", "1000"])
    least = int(line.rsplit("at least ", 1)[1])
    line = _fails(capsys, [*base, "--target-bpw", "2"])
    assert "all NVFP4" in line and "ask for at least 4." in line
    assert _fails(capsys, [*base, "--budget", "0.1"]).endswith(
        "write it as kl=X, X the mean KL in nats (e.g. kl=0.01)"
    )
    assert "must be a positive number" in _fails(capsys, [*base, "--budget", "kl=0"])
    assert "drop --quantize" in _fails(capsys, [*base, "--budget", "kl=1", "--quantize", "attention"])
    assert "scale_method='mse'" in _fails(capsys, [*base, "--budget", "kl=1", "--scale-method", "rtn"])
    # the values named are feasible
    assert main([*base, "--budget", f"kl={feasible}"]) == 0
    assert main([*base[:2], str(tmp_path / "y"), *base[3:], "--target-bytes", str(least)]) == 0
    by_folder = [*base[:2], str(tmp_path / "z"), *base[3:-1], str(out)]  # --sensitivity OUTPUT_DIR: its table
    assert main([*by_folder, "--budget", f"kl={feasible}"]) == 0
    assert all(f == P.BF16 or p == "experts" for (_, p), f in
               search(SensitivityTable.load(table), SearchTarget("kl", float(feasible))).formats.items())  # fmt: skip


def test_interrupted_search_leaves_no_output_and_resumes(planted, tmp_path, monkeypatch):
    """Ctrl-C in the quantize pass (after the table was measured): DST absent, no temporary folder left once
    the next run starts, the measured table saved beside DST; the next run resumes from it without
    measuring and writes the same tensors as an uninterrupted run."""
    src, out, _ = planted
    dst = tmp_path / "q"
    opts = _options(target=SearchTarget("kl", 100.0))

    def interrupt(*a, **k):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr("fp4moe.quantize.pipeline.write_experts", interrupt)
        with pytest.raises(KeyboardInterrupt):
            quantize(src, dst, opts)
    saved = search_pass.saved_table_path(dst)
    assert not dst.exists() and saved.exists()
    assert SensitivityTable.load(saved).parts == _table(out).parts
    with monkeypatch.context() as m:
        m.setattr(search_pass, "measure_table", interrupt)  # resuming must not measure again
        quantize(src, dst, _options(target=SearchTarget("kl", 100.0), sensitivity=str(saved)))
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    assert not saved.exists()  # the output holds the table now
    assert _same_bytes(load_all(out), load_all(dst))


def test_ctrl_c_names_the_kept_table_and_how_to_resume(planted, tmp_path, monkeypatch, capsys):
    src, _, _ = planted
    dst = tmp_path / "c"

    def interrupt(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr("fp4moe.quantize.pipeline.write_experts", interrupt)
    argv = ["quantize", str(src), str(dst), "--no-progress", "--num-samples", "8", "--seq-len", "64",
            "--calib-dtype", "float32", "--sensitivity-samples", "4", "--budget", "kl=100"]  # fmt: skip
    capsys.readouterr()
    assert main(argv) == 130
    saved = search_pass.saved_table_path(dst)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"fp4moe quantize: interrupted; nothing was written but the measured table, {saved}: add "
                   f"--sensitivity {saved} to resume"], err  # fmt: skip
    assert not dst.exists() and saved.exists()


def test_part_bytes_match_the_written_tensors(planted):
    """The bytes the search counts are the bytes the checkpoint holds (safetensors headers aside)."""
    _, out, report = planted
    written = sum(t.numel() * t.element_size() for t in load_all(out).values())
    assert written == report.search["bytes"]


def test_sensitivity_table_round_trips_and_validates(tmp_path):
    t = SensitivityTable(
        {"a": 1}, 8, 10, [PartCost(0, "shared", 4, {"bf16": 8, "nvfp4": 3}, {"bf16": 0.0, "nvfp4": 0.1})]
    )
    t.save(tmp_path / "t.json")
    assert SensitivityTable.load(tmp_path / "t.json") == t
    with pytest.raises(ValueError, match="unknown part"):
        PartCost(0, "router", 1, {}, {})


def test_gptq_is_a_candidate_for_the_experts_per_layer(checkpoints, tmp_path):
    """With --gptq the routed experts are measured with and without GPTQ (same bytes) and each layer takes
    the one of lower KL; the build's measured KL stays within the fixture's predictor range."""
    out = tmp_path / "q"
    s = quantize(checkpoints.bf16(), out, _options(gptq=True, target=SearchTarget("kl", 100.0))).search
    table = _table(out)
    chosen = {(r["layer"], r["part"]): r["format"] for r in s["formats"]}
    for c in (c for c in table.parts if c.part == "experts"):
        assert c.bytes[P.NVFP4_GPTQ] == c.bytes[P.NVFP4]
        best = min((P.NVFP4, P.NVFP4_GPTQ), key=c.kl.__getitem__)
        assert chosen[(c.layer, "experts")] == best
    assert 0.3 <= s["measured_kl"] / s["predicted_kl"] <= 1.1
