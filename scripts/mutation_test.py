"""Mutation testing: plant known bugs in a copy of the tree and report which tests catch each one.

    python scripts/mutation_test.py                      # every mutant, a markdown table on stdout
    python scripts/mutation_test.py --only sampler-race  # some of them (ids, comma-separated)
    python scripts/mutation_test.py --list               # the table of mutants, nothing run

Each mutant replaces one exact snippet of one source file (it must occur exactly once) in a temporary copy
of the working tree -- never the tree itself -- and runs its area's tests there (``pytest -x``, a narrow
selection, a time limit). A mutant is *killed* when a test fails, *SURVIVED* when they all pass (a bug those
tests cannot see: a defect of the tests), *TIMEOUT* when the limit ran out (reported apart: a hang is a
catch only for mutants meant to hang). ``path`` is a hint: when the file moved (the engine's files going
into sub-packages), the snippet is looked up under ``src/`` instead, so only the snippet has to stay exact.
Choose a mutant as a bug someone could really write (a sign, an off-by-one, a forgotten rounding, a
swapped argument), not one tuned to the tests at hand.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutant:
    id: str
    area: str
    path: str  # a hint, relative to the repository root (looked up by the snippet when it is stale)
    original: str
    replacement: str
    tests: tuple[str, ...]  # pytest node ids or files: the area's tests, cheapest killers first
    why: str = ""
    xdist: bool = False  # run the tests under pytest-xdist (-n 2), as CI does (for what only shows there)


CUDA = "tests/engine/test_cuda_runner.py"
SPEC = "tests/engine/test_cuda_spec.py"
SAMPLER = "tests/engine/test_sampler.py"
# the sampler's unit tests (no engine): distributions, exact greedy rows, filters, penalties, seeds
SAMPLER_UNITS = tuple(
    f"{SAMPLER}::{name}"
    for name in (
        "test_batched_draws_follow_the_reference_distribution",
        "test_seeded_draws_follow_the_reference_distribution",
        "test_batched_greedy_rows_and_logprobs_are_exact_against_the_reference",
        "test_seeded_rows_depend_on_their_seed_alone",
        "test_top_k_only_draws_the_k_best",
        "test_top_p_keeps_the_smallest_set_reaching_p",
        "test_min_p_drops_tokens_below_a_fraction_of_the_top",
        "test_penalties_change_only_what_they_should",
    )
)
SPEC_SAMPLING = "tests/engine/test_spec_sampling.py"
SEARCH = "tests/quantize/test_search.py"

# fmt: off
MUTANTS = [
    # ---- the fused forward (models/qwen3_5_moe_fused.py) -----------------------------------------------
    Mutant(
        "fused-post-norm-weight", "fused forward", "src/fp4moe/models/qwen3_5_moe_fused.py",
        "h, x = norm.add_rms_norm(h, out, layer.post_attention_layernorm.weight, a.eps, x_k=x_k)",
        "h, x = norm.add_rms_norm(h, out, layer.input_layernorm.weight, a.eps, x_k=x_k)",
        (f"{CUDA}::test_fused_decode_gives_the_module_paths_greedy_tokens",),
        "the MoE's input normed with the layer's other norm weight",
    ),
    Mutant(
        "fused-combine-width", "fused forward", "src/fp4moe/models/qwen3_5_moe_fused.py",
        "return norm.moe_combine(h, routed, k, shared, rp, e + 2 * s_inter, next_w, a.eps)",
        "return norm.moe_combine(h, routed, k, shared, rp, e + s_inter, next_w, a.eps)",
        (f"{CUDA}::test_fused_decode_gives_the_module_paths_greedy_tokens",),
        "the router projection's row width off by the shared expert's up part",
    ),
    Mutant(
        "fused-mtp-concat-order", "fused forward (MTP head)", "src/fp4moe/models/qwen3_5_moe_fused.py",
        "h = mtp.fc(torch.cat([e, mtp.pre_fc_norm_hidden(hidden)], dim=-1))",
        "h = mtp.fc(torch.cat([mtp.pre_fc_norm_hidden(hidden), e], dim=-1))",
        (f"{SPEC}::test_first_drafts_on_the_fused_mtp_rows_are_the_module_paths",),
        "the MTP head's embedding and hidden halves swapped",
    ),
    Mutant(
        "fused-attention-length", "fused forward (KV cache)", "src/fp4moe/models/qwen3_5_moe_fused.py",
        "return table, slot_map, pos + 1",
        "return table, slot_map, torch.clamp(pos, min=1)",
        (f"{CUDA}::test_fused_decode_gives_the_module_paths_greedy_tokens",),
        "decode attention misses the row's own key (off by one)",
    ),
    # ---- the kernels' wrappers -------------------------------------------------------------------------
    Mutant(
        "attn-prefill-scale", "kernel wrapper (attention)", "src/fp4moe/kernels/attention.py",
        "step.slots, step.cached, step.starts, step.ends, kv_scales, d**-0.5 * LOG2E,",
        "step.slots, step.cached, step.starts, step.ends, kv_scales, (d + 1) ** -0.5 * LOG2E,",
        ("tests/kernels/test_attention.py",),
        "the paged prefill's softmax scale 1/sqrt(d+1): 1.5% off",
    ),
    Mutant(
        "attn-decode-scale", "kernel wrapper (attention)", "src/fp4moe/kernels/attention.py",
        "part_o, part_ml, d**-0.5 * LOG2E, split, nsplit,",
        "part_o, part_ml, d**-0.5, split, nsplit,",
        ("tests/kernels/test_attention.py::test_paged_attention_matches_the_layer",),
        "the decode kernel's scale without log2(e) (exp2 softmax at the wrong temperature)",
    ),
    Mutant(
        "norm-residual-rounding", "kernel (add + rms norm)", "src/fp4moe/kernels/norm.py",
        "h = round_bf16(h + tl.load(add_ptr + t * N + offs, mask=mask, other=0.0).to(tl.float32))",
        "h = h + tl.load(add_ptr + t * N + offs, mask=mask, other=0.0).to(tl.float32)",
        ("tests/kernels/test_fused_ops.py",),
        "the residual normed before its bf16 rounding (a last-bit difference from the modules)",
    ),
    # ---- routing -----------------------------------------------------------------------------------------
    Mutant(
        "router-kernel-renorm", "routing (router kernel)", "src/fp4moe/kernels/moe_router.py",
        "top_w = top_w / tl.sum(top_w, 0)",
        "top_w = top_w / tl.sum(p, 0)",
        ("tests/kernels/test_fused_ops.py",),
        "top-k weights not renormalised",
    ),
    Mutant(
        "router-module-topk", "routing (module path)", "src/fp4moe/layers/moe.py",
        "probs = F.softmax(logits, dim=-1, dtype=torch.float32)",
        "probs = F.softmax(logits, dim=0, dtype=torch.float32)",
        ("tests/engine/test_parity.py::test_prefill_logits_match_transformers_for_a_flat_batch",),
        "the module path's router softmax over the tokens instead of the experts",
    ),
    # ---- samplers ------------------------------------------------------------------------------------------
    Mutant(
        "sampler-race", "sampler (batched)", "src/fp4moe/engine/request/sampler.py",
        "tokens[d] = (probs / q).argmax(-1)",
        "tokens[d] = (probs / q.sqrt()).argmax(-1)",
        SAMPLER_UNITS,
        "the exponential race with the wrong noise: a distribution sharper than p",
    ),
    Mutant(
        "sampler-top-p-batched", "sampler (batched top-p)", "src/fp4moe/engine/request/sampler.py",
        "drop = (probs.cumsum(-1) - probs) >= p\n",
        "drop = probs.cumsum(-1) >= p\n",
        SAMPLER_UNITS,
        "top-p drops the token that crosses p (the smallest set reaching p loses its last member)",
    ),
    Mutant(
        "sampler-min-p-batched", "sampler (batched min-p)", "src/fp4moe/engine/request/sampler.py",
        "floor = to_device(min_p, torch.float32, device)[:, None] * probs.amax(-1, keepdim=True)",
        "floor = to_device(min_p, torch.float32, device)[:, None] * probs.sum(-1, keepdim=True)",
        SAMPLER_UNITS,
        "min-p relative to the total (1) instead of the top probability",
    ),
    Mutant(
        "sampler-repetition-sign", "sampler (batched penalties)", "src/fp4moe/engine/request/sampler.py",
        "x = torch.where(mask, torch.where(x > 0, x / r, x * r), x)",
        "x = torch.where(mask, torch.where(x > 0, x / r, x / r), x)",
        SAMPLER_UNITS,
        "repetition penalty divides negative logits too (makes repeated unlikely tokens likelier)",
    ),
    Mutant(
        "sampler-seed-ignored", "sampler (seeded rows)", "src/fp4moe/engine/request/sampler.py",
        "noise.manual_seed(int(torch.randint(1 << 62, (), generator=gen)))",
        "noise.manual_seed(int(torch.randint(1 << 62, (), generator=gen)) % 2)",
        SAMPLER_UNITS,
        "seeded rows share one of two noise streams whatever their seed",
    ),
    Mutant(
        "spec-residual", "rejection sampler (speculation)", "src/fp4moe/engine/spec/spec_sampling.py",
        "residual = (pa - qa).clamp(min=0)",
        "residual = (pa - 0.5 * qa).clamp(min=0)",
        (SPEC_SAMPLING,),
        "the residual after a rejection subtracts half the draft's mass: biased toward drafted tokens",
    ),
    Mutant(
        "spec-acceptance-test", "rejection sampler (speculation)", "src/fp4moe/engine/spec/spec_sampling.py",
        "ok = (u_accept * qd <= pd) & (pd > 0)",
        "ok = (u_accept * qd <= pd * 1.25) & (pd > 0)",
        (SPEC_SAMPLING,),
        "drafts accepted a quarter too often",
    ),
    Mutant(
        "spec-top-k-off-by-one", "rejection sampler (top-k)", "src/fp4moe/engine/spec/spec_sampling.py",
        "kth = sx.gather(1, (k.clamp(1, v) - 1)[:, None])",
        "kth = sx.gather(1, k.clamp(0, v - 1)[:, None])",
        (SPEC_SAMPLING,),
        "the fused filter keeps k + 1 tokens",
    ),
    # ---- KV cache ------------------------------------------------------------------------------------------
    Mutant(
        "kv-pages-floor", "KV cache (pages)", "src/fp4moe/engine/runner/paged_cache.py",
        "need = -(-length // self.page_size) - len(pages)",
        "need = (length + 1) // self.page_size - len(pages)",
        ("tests/kernels/test_attention.py", "tests/engine/test_scheduler.py"),
        "pages rounded down: a sequence's last partial page is missing",
    ),
    Mutant(
        "kv-free-leak", "KV cache (free list)", "src/fp4moe/engine/runner/paged_cache.py",
        "self._free.extend(reversed(self._pages.pop(slot, [])))",
        "self._free.extend(reversed(self._pages.pop(slot, [])[1:]))",
        ("tests/engine/test_scheduler.py::test_abort_frees_everything", f"{CUDA}::test_more_prompts_than_state_slots_run_in_waves"),
        "a freed slot's first page never comes back",
    ),
    Mutant(
        "kv-fp8-scale", "KV cache (fp8 scales)", "src/fp4moe/formats/fp8.py",
        "return torch.clamp(amax.float() * headroom / MAX, min=floor)",
        "return torch.clamp(amax.float() * headroom / 240.0, min=floor)",
        ("tests/formats/test_fp8.py", "tests/engine/test_kv_cache_scales.py"),
        "fp8 scales for e4m3fnuz's 240 instead of e4m3fn's 448",
    ),
    # ---- the quantizer's scale math ------------------------------------------------------------------------
    Mutant(
        "quant-block-scale", "quantizer (block scales)", "src/fp4moe/formats/nvfp4.py",
        "scales = gs * _div(block_max, FP4_MAX)",
        "scales = gs * _div(block_max, FP4_MAX + 0.5)",
        ("tests/formats/test_nvfp4.py", "tests/quantize/test_scale_methods.py"),
        "block max mapped to 6.5 instead of 6",
    ),
    Mutant(
        "quant-mse-tie", "quantizer (MSE scale search)", "src/fp4moe/quantize/scales.py",
        "better = err < least  # strict: RTN's scale wins ties",
        "better = err <= least",
        ("tests/quantize/test_scale_methods.py",),
        "on a tie the last candidate wins, not RTN's scale",
    ),
    Mutant(
        "quant-gptq-dead-column", "quantizer (GPTQ)", "src/fp4moe/quantize/gptq.py",
        "dead = diag == 0",
        "dead = diag < 0",
        ("tests/quantize/test_gptq.py",),
        "GPTQ no longer spots dead columns (zero Hessian diagonal)",
    ),
    # ---- the server's stop/abort logic ----------------------------------------------------------------------
    Mutant(
        "read-ahead-threads", "quantizer (read-ahead worker)", "src/fp4moe/quantize/pipeline.py",
        "initializer=torch.set_num_threads, initargs=(1,)",
        "initializer=None, initargs=()",
        ("tests/quantize/test_read_ahead.py",),
        "the read-ahead worker runs torch on the caller's thread count (under xdist, as CI runs it)",
        xdist=True,
    ),
    Mutant(
        "stop-string-window", "stop strings", "src/fp4moe/engine/request/sequence.py",
        "search_from = max(0, previous_len - longest + 1)",
        "search_from = max(0, previous_len)",
        ("tests/engine/test_detokenize.py", f"{SAMPLER}::test_stop_string_split_across_tokens_is_never_streamed"),
        "a stop string split across tokens is missed",
    ),
    Mutant(
        "stop-token-ids", "stop tokens", "src/fp4moe/engine/request/sequence.py",
        "or token in self.params.stop_token_ids\n",
        "or token in self.params.stop_token_ids[1:]\n",
        (f"{SAMPLER}::test_stop_token_ids_and_length",),
        "the first stop token id ignored",
    ),
    Mutant(
        "abort-waiting", "abort (scheduler)", "src/fp4moe/engine/loop/scheduler.py",
        "        if seq in self.waiting:\n            self.waiting.remove(seq)\n",
        "",
        ("tests/engine/test_scheduler.py::test_abort_frees_everything", "tests/engine/test_scheduler.py"),
        "an aborted request that has not started stays queued",
    ),
    Mutant(
        "abort-server-queue", "abort (server engine thread)", "src/fp4moe/engine/front/async_engine.py",
        "        for seq in seqs:\n            self._queues.pop(id(seq), None)\n        self._inbox.append((\"abort\", seqs))",
        "        self._inbox.append((\"abort\", seqs[1:]))",
        ("tests/server/test_server.py", "tests/server/test_hangups.py"),
        "an aborted request's queue and its first sequence are left running",
    ),
    # ---- the format search (quantize --budget) ------------------------------------------------------------
    Mutant(
        "search-floor", "format search", "src/fp4moe/quantize/search.py",
        "choice = _knapsack(extra, costs, target.value - least_kl)",
        "choice = _knapsack(kls, costs, target.value - least_kl)",
        (f"{SEARCH}::test_search_meets_every_target_and_is_optimal", SEARCH),
        "each part's KL counted whole against the budget above the floor",
    ),
    Mutant(
        "search-knapsack-max", "format search", "src/fp4moe/quantize/search.py",
        "better = shifted < new", "better = (shifted > new) & np.isfinite(shifted) | ~np.isfinite(new)",
        (f"{SEARCH}::test_knapsack_matches_brute_force", SEARCH),
        "the knapsack keeps the costlier choice",
    ),
    Mutant(
        "sensitivity-start", "sensitivity pass", "src/fp4moe/quantize/sensitivity.py",
        "        shapes = layer_shapes(tensors)\n",
        "        shapes = layer_shapes(tensors)\n        self.held_out = calibrate.run_layer(layer, self.held_out, self.rotary, bs)\n",
        (f"{SEARCH}::test_predictor_exact_on_one_layer_and_bounded_on_the_fixture", SEARCH),
        "candidates start from the layer's output instead of its input",
    ),
    Mutant(
        "sensitivity-swap-back", "sensitivity pass", "src/fp4moe/quantize/parts.py",
        "            setattr(self.layer.get_submodule(module_name), attr, p)", "            pass",
        (f"{SEARCH}::test_predictor_exact_on_one_layer_and_bounded_on_the_fixture", SEARCH),
        "a candidate's quantized weights stay in the layer after it was measured",
    ),
    Mutant(
        "search-card-command", "format search (card)", "src/fp4moe/quantize/card.py",
        '        ("--sensitivity-samples", options.sensitivity_samples, d.sensitivity_samples),\n', "",
        (f"{SEARCH}::test_card_command_carries_the_options_that_change_the_bytes", SEARCH),
        "the rebuild command drops --sensitivity-samples (another held-out split, other calibration windows)",
    ),
    Mutant(
        "search-groups-unwritten", "format search (pipeline)", "src/fp4moe/quantize/pipeline.py",
        "            groups = run.assignment.layer_groups(i)", "            groups = []",
        (f"{SEARCH}::test_part_bytes_match_the_written_tensors", SEARCH),
        "the quantize pass writes the searched groups in bf16",
    ),
    Mutant(
        "search-table-unsaved", "format search (resume)", "src/fp4moe/quantize/search_pass.py",
        "        table.save(saved_table_path(dst))", "        pass",
        (f"{SEARCH}::test_interrupted_search_leaves_no_output_and_resumes",),
        "the measured table is not kept beside DST, so an interrupted run cannot resume",
    ),
    Mutant(
        "search-nvfp4-bytes", "format search (sizes)", "src/fp4moe/quantize/parts.py",
        "return n // 2 + n // nvfp4.BLOCK_SIZE + 2 * SCALAR_BYTES", "return n // 2 + 2 * SCALAR_BYTES",
        (f"{SEARCH}::test_part_bytes_match_the_written_tensors",),
        "NVFP4's bytes counted without the block scales",
    ),
]
# fmt: on


def locate(m: Mutant, root: Path) -> Path:
    """The file holding ``m.original`` exactly once: the hinted path, else the one file under src/ with it."""
    hinted = root / m.path
    if hinted.exists() and hinted.read_text().count(m.original) == 1:
        return hinted
    found = [p for p in (root / "src").rglob("*.py") if p.read_text().count(m.original) == 1]
    if len(found) != 1:
        raise SystemExit(f"mutant {m.id}: its snippet is in {len(found)} files under src/ (need exactly 1)")
    return found[0]


def copy_tree(dst: Path) -> None:
    """The working tree as it is (tracked and untracked files git does not ignore) into ``dst``."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout.split(b"\0")  # fmt: skip
    for f in files:
        if not f:
            continue
        src = ROOT / f.decode()
        if src.is_file():
            out = dst / f.decode()
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, out)


def run_mutant(m: Mutant, base: Path, python: str, timeout: float, workers: int) -> tuple[str, float]:
    """Applies ``m`` to a fresh copy of ``base`` and runs its tests -> (outcome, seconds)."""
    with tempfile.TemporaryDirectory(prefix=f"mutant-{m.id}-") as tmp:
        tree = Path(tmp) / "tree"
        shutil.copytree(base, tree)
        target = locate(m, tree)
        text = target.read_text()
        target.write_text(text.replace(m.original, m.replacement, 1))
        env = {**os.environ, "PYTHONPATH": str(tree / "src"), "PYTHONDONTWRITEBYTECODE": "1"}
        cmd = [python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *m.tests]
        if workers > 1 or m.xdist:
            cmd[4:4] = ["-n", str(max(workers, 2))]
        start = time.monotonic()
        try:
            proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return f"TIMEOUT after {timeout:.0f} s", time.monotonic() - start
        took = time.monotonic() - start
        out = proc.stdout + proc.stderr
        failed = sorted(set(re.findall(r"^(?:FAILED|ERROR) (\S+)", out, re.M)))
        if proc.returncode == 0:
            return "SURVIVED", took
        if failed:
            return ", ".join(f"`{f.split('/')[-1]}`" for f in failed), took
        tail = out.strip().splitlines()[-3:]
        return f"error (rc {proc.returncode}): {' | '.join(tail)}", took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="comma-separated mutant ids (default: all)")
    ap.add_argument("--list", action="store_true", help="print the table of mutants and run nothing")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per mutant's test run")
    ap.add_argument("--workers", type=int, default=1, help="pytest-xdist workers per run (1: none)")
    ap.add_argument("--python", default=sys.executable, help="the interpreter with the test dependencies")
    ap.add_argument("--tree", type=Path, help="mutate a copy of this directory instead of the working tree")
    args = ap.parse_args()
    chosen = [m for m in MUTANTS if not args.only or m.id in args.only.split(",")]
    if args.only and len(chosen) != len(args.only.split(",")):
        known = {m.id for m in MUTANTS}
        raise SystemExit(f"unknown mutant ids: {sorted(set(args.only.split(',')) - known)}")
    with tempfile.TemporaryDirectory(prefix="mutation-base-") as tmp:
        base = Path(tmp) / "tree"
        if args.tree:
            shutil.copytree(args.tree, base, ignore=shutil.ignore_patterns("__pycache__", ".venv"))
        else:
            copy_tree(base)
        for m in chosen:
            locate(m, base)  # every snippet found before anything runs
        print("| mutant | area | bug | file | tests run | outcome | s |")
        print("|---|---|---|---|---|---|---|")
        survived = 0
        for m in chosen:
            where = locate(m, base).relative_to(base)
            tests = ", ".join(f"`{t.split('/')[-1]}`" for t in m.tests)
            if args.list:
                print(f"| {m.id} | {m.area} | {m.why} | `{where}` | {tests} | | |", flush=True)
                continue
            outcome, took = run_mutant(m, base, args.python, args.timeout, args.workers)
            survived += outcome == "SURVIVED"
            print(
                f"| {m.id} | {m.area} | {m.why} | `{where}` | {tests} | {outcome} | {took:.0f} |", flush=True
            )
    if not args.list:
        print(f"\n{len(chosen) - survived} of {len(chosen)} mutants killed")
    return 1 if survived else 0


if __name__ == "__main__":
    raise SystemExit(main())
