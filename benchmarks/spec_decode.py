"""MTP speculative decoding (issue 6): decode speed and draft acceptance vs the number of draft tokens k.

    python benchmarks/spec_decode.py .models/reference --device cuda --ks 0 1 2 3 --batches 1 8 \
        --context 1024 --max-tokens 128 --out spec.json
    python benchmarks/spec_decode.py --full-size --ks 0 1 2 3 --batches 1 8 32 --contexts 1024 32768 \
        --out spec-full.json                     # timing only, on the GPU


Prompts are consecutive windows of the packaged held-out text (CPython's language reference), ``--context``
tokens each, a different window per sequence; greedy decoding with ``ignore_eos`` for ``--max-tokens``
tokens. For each k one engine is built; per batch size a warm-up run, then the timed run. Decode tok/s
counts generated tokens after the first over the time after prefill (the time of a 1-token run of the same
prompts is subtracted). Acceptance comes from the engine's own counters (drafts, draft tokens, accepted per
position). Every k > 0 run must give the k = 0 run's tokens (greedy speculation is lossless): the table
says where it did not.

``--full-size``: the full-size Qwen3.5-35B-A3B text model with random weights and a random MTP head
(NVFP4 experts, built on the GPU as in ``decode.py``), timing only. A fused speculative round has static
shapes -- its work does not depend on how many drafts are accepted -- so the acceptance-forcing switch
(``FusedSpecRound.forced``) makes every sequence accept a = 0..k drafts and the round is timed for each
(engine rounds: host work and the read-back included). k = 0 is the plain engine decode step. From these,
tok/s at forced acceptance a is B (a + 1) / round time, and the expected speedup at a per-draft acceptance
rate alpha (independent positions, as the draft head's acceptance is usually quoted) is
(1 + alpha + ... + alpha^k) x step time / round time. ``--sampling temperature`` / ``top-p`` times the
round's sampled variants instead (rejection sampling on the device; top-p sorts every vocabulary row).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from provenance import write_result


def prompts_from_heldout(tokenizer, count: int, length: int) -> list[list[int]]:
    from fp4moe.data import corpus_text

    ids = tokenizer(corpus_text("heldout"))["input_ids"]
    if len(ids) < count * length:
        raise SystemExit(f"held-out text has {len(ids)} tokens: too few for {count} prompts of {length}")
    return [ids[i * length : (i + 1) * length] for i in range(count)]


def timed(llm, prompts, params, device) -> tuple[float, list]:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="checkpoint with an MTP head (e.g. the trained reference model)")
    ap.add_argument("--full-size", action="store_true", help="time the full-size random model instead (GPU)")
    ap.add_argument(
        "--contexts", nargs="+", type=int, default=[1024, 32768], help="--full-size: context lengths"
    )
    ap.add_argument("--rounds", type=int, default=20, help="--full-size: timed rounds per point")
    ap.add_argument(
        "--sampling",
        choices=list(SAMPLING),
        default="greedy",
        help="--full-size: the fused round's variant to time: greedy (default), temperature (0.7: sampled, "
        "no sort) or top-p (0.7 and top-p 0.95: sampled with a sort of each vocabulary row)",
    )
    ap.add_argument(
        "--draft-vocabs", nargs="+", type=int, default=[0],
        help="--full-size: MTP draft vocabulary sizes to time each k with (engine.spec.draft_vocab; 0: the whole "
        "vocabulary, the default)",
    )  # fmt: skip
    ap.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="default: cuda when there is one",
    )
    ap.add_argument(
        "--ks", nargs="+", type=int, default=[0, 1, 2, 3], help="draft tokens per step to compare"
    )
    ap.add_argument(
        "--round-tokens", nargs="+", choices=["random", "same"], default=["random"],
        help="--full-size: the tokens each timed round verifies: random ids, a different one per row (the "
        "default: rows route to different experts, as real text does) or id 1 in every row (the runs before "
        "2026-12-05: rows that route alike make the verification cheaper)",
    )  # fmt: skip
    ap.add_argument(
        "--profile", action="store_true",
        help="--full-size: also where the GPU's time goes in the plain step and in each round (graph replays "
        "under the torch profiler: span, busy time, kernel count, kernels by device time)",
    )  # fmt: skip
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8], help="concurrent sequences")
    ap.add_argument("--context", type=int, default=1024, help="prompt tokens per sequence (default 1024)")
    ap.add_argument("--max-tokens", type=int, default=128, help="generated tokens per sequence (default 128)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per point; the median is kept")
    ap.add_argument(
        "--dtype",
        default="bfloat16",
        help="bfloat16 (default) or float32: in bf16, batched plain decoding and per-sequence verification "
        "round differently, so near-tied tokens may differ from k = 0 at batch > 1",
    )
    ap.add_argument("--out", default="spec-decode.json", help="JSON results")
    args = ap.parse_args()
    if args.full_size:
        return full_size(args)
    if not args.model:
        ap.error("give a checkpoint with an MTP head, or --full-size")

    from fp4moe.engine.front.llm import LLM
    from fp4moe.engine.request.sampler import SamplingParams

    device = torch.device(args.device)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    rows, reference = [], {}
    for k in args.ks:
        llm = LLM(
            args.model, dtype=args.dtype, device=args.device, num_speculative_tokens=k,
            max_model_len=args.context + args.max_tokens + 16,
        )  # fmt: skip
        prompts_all = prompts_from_heldout(llm.tokenizer, max(args.batches), args.context)
        for b in args.batches:
            prompts = prompts_all[:b]
            timed(llm, prompts, params, device)  # warm-up: compiles kernels, captures graphs
            prefill = statistics.median(timed(llm, prompts, first, device)[0] for _ in range(args.repeats))
            before = _stats(llm)
            runs = [timed(llm, prompts, params, device) for _ in range(args.repeats)]
            after = _stats(llm)
            seconds = statistics.median(t for t, _ in runs)
            tokens = [o.outputs[0].token_ids for o in runs[0][1]]
            if k == 0:
                reference[b] = tokens
            decode_s = max(seconds - prefill, 1e-9)
            row = dict(k=k, batch=b, seconds=seconds, prefill_seconds=prefill,
                       decode_tok_s=b * (args.max_tokens - 1) / decode_s,
                       identical_to_k0=(tokens == reference[b]) if b in reference else None)  # fmt: skip
            if k > 0:
                d = {key: after[key] - before[key] for key in ("drafts", "draft_tokens", "accepted")}
                per_pos = [a - c for a, c in zip(after["per_position"], before["per_position"], strict=True)]
                row.update(
                    acceptance=d["accepted"] / max(d["draft_tokens"], 1),
                    per_position=[p / max(d["drafts"], 1) for p in per_pos],
                    mean_acceptance_length=1 + d["accepted"] / max(d["drafts"], 1),
                )
            rows.append(row)
            base = next((r for r in rows if r["k"] == 0 and r["batch"] == b), None)
            row["speedup"] = row["decode_tok_s"] / base["decode_tok_s"] if base else None
            print(json.dumps(row), flush=True)
        del llm
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out = dict(date=datetime.date.today().isoformat(), device=_device_name(device), model=args.model,
               context=args.context, max_tokens=args.max_tokens, rows=rows)  # fmt: skip
    write_result(args.out, out, repeats=args.repeats)
    print(
        "\n| k | batch | decode tok/s | speedup vs k=0 | acceptance | per position | mean accepted length | lossless |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        acc = "-" if r["k"] == 0 else f"{r['acceptance']:.1%}"
        pos = "-" if r["k"] == 0 else " / ".join(f"{p:.0%}" for p in r["per_position"])
        mal = "-" if r["k"] == 0 else f"{r['mean_acceptance_length']:.2f}"
        same = (
            "-" if r["identical_to_k0"] is None or r["k"] == 0 else ("yes" if r["identical_to_k0"] else "NO")
        )
        speed = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        print(
            f"| {r['k']} | {r['batch']} | {r['decode_tok_s']:.1f} | {speed} | {acc} | {pos} | {mal} | {same} |"
        )
    return 0


ALPHAS = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
SAMPLING = {
    "greedy": {"temperature": 0.0},
    "temperature": {"temperature": 0.7},
    "top-p": {"temperature": 0.7, "top_p": 0.95},
}


def full_size(args) -> int:
    sys.path.insert(0, str(Path(__file__).parent))
    import common

    from fp4moe.engine.request.sampler import SamplingParams
    from fp4moe.engine.spec.cuda_spec import FusedSpecRound
    from fp4moe.engine.spec.draft_vocab import draft_token_ids

    dev = torch.device("cuda")
    sampling_params = SamplingParams(**SAMPLING[args.sampling])
    model = common.build_model(True, dev)
    common.add_mtp_head(model)
    rows = []
    for ctx in args.contexts:
        for b in args.batches:
            step_s = common.time_decode(model, b, ctx, "auto")["engine_s"]
            rows.append(dict(k=0, batch=b, context=ctx, step_s=step_s, tok_s=b / step_s))
            if args.profile:
                rows[-1]["profile"] = step_profile(common, model, b, ctx)
                print(json.dumps(_brief(rows[-1]["profile"])), flush=True)
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "profile"}), flush=True)
            points = [
                (k, v, t) for k in args.ks if k > 0 for v in args.draft_vocabs for t in args.round_tokens
            ]
            for k, vocab, kind in points:
                ids = draft_token_ids(model.args.vocab_size, vocab) if vocab else None
                model.mtp.use_draft_vocab(model, ids)
                runner = common.random_runner(
                    model, b, ctx, "auto", (args.rounds + 2) * (k + 1), spec_tokens=k
                )
                fused = FusedSpecRound(runner, k)
                fused.forced = torch.zeros(1, dtype=torch.long, device=dev)
                slots = list(range(b))
                if kind == "same":
                    tokens = [[1] * (k + 1) for _ in range(b)]
                else:
                    tokens = torch.randint(0, model.args.vocab_size, (b, k + 1)).tolist()
                by_accepted = {}
                for a in range(k + 1):
                    fused.forced.fill_(a)
                    position = ctx

                    def one_round(fused=fused, a=a, slots=slots, tokens=tokens, k=k):
                        nonlocal position
                        sampling = None
                        if not sampling_params.greedy:  # the uniforms are drawn per round, as in serving
                            uniforms = torch.rand(len(slots), 2 * k + 1)
                            sampling = ([sampling_params] * len(slots), uniforms)
                        fused(slots, [position] * len(slots), tokens, [0] * len(slots), sampling=sampling)
                        position += a + 1

                    one_round()  # captures the bucket's graph on the first use
                    by_accepted[a] = statistics.median(common.event_seconds(one_round, args.rounds))
                round_s = statistics.median(by_accepted.values())
                row = dict(
                    k=k, batch=b, context=ctx, sampling=args.sampling, draft_vocab=vocab, round_tokens=kind,
                    round_s=round_s,
                    round_over_step=round_s / step_s,
                    round_s_by_accepted=by_accepted,
                    tok_s_by_accepted={a: b * (a + 1) / t for a, t in by_accepted.items()},
                    speedup_at_alpha={al: sum(al**j for j in range(k + 1)) * step_s / round_s for al in ALPHAS},
                )  # fmt: skip
                if args.profile:  # the graph's own time, at every draft accepted
                    fused.forced.fill_(k)
                    fused(slots, [ctx] * b, tokens, [0] * b)  # back to the context's end (pages reserved)
                    graph, _ = fused.graphs[runner.graph_bucket(b), 0]
                    row["profile"] = common.timeline(graph.replay)
                    print(json.dumps(_brief(row["profile"])), flush=True)
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "profile"}), flush=True)
                del runner, fused
                torch.cuda.empty_cache()
    out = dict(date=datetime.date.today().isoformat(), device=torch.cuda.get_device_name(), model="full-size",
               rows=rows)  # fmt: skip
    write_result(args.out, out, repeats=1)  # one run: each figure the median of --rounds timed rounds in it
    print(
        "\n| context | batch | k | draft vocabulary | round tokens | step or round ms | round / step | "
        + " | ".join(f"x at {a:.0%}" for a in ALPHAS)
        + " |"
    )
    print("|---|---|---|---|---|---|---|" + "---|" * len(ALPHAS))
    for r in rows:
        if r["k"] == 0:
            print(
                f"| {r['context']} | {r['batch']} | 0 | - | - | {r['step_s'] * 1e3:.2f} | - |"
                + " - |" * len(ALPHAS)
            )
        else:
            gains = " | ".join(f"{r['speedup_at_alpha'][a]:.2f}" for a in ALPHAS)
            print(
                f"| {r['context']} | {r['batch']} | {r['k']} | {r['draft_vocab'] or 'all'} | {r['round_tokens']} | "
                f"{r['round_s'] * 1e3:.2f} | "
                f"{r['round_over_step']:.2f} | {gains} |"
            )
    return 0


def step_profile(common, model, b: int, ctx: int) -> dict:
    """The plain decode step's graph replay under the profiler (random distinct tokens, as timed)."""
    runner = common.random_runner(model, b, ctx, "auto", 8)
    tokens = torch.randint(0, model.args.vocab_size, (b,), device=model.embed_tokens.device)
    runner.decode_logits(list(range(b)), tokens, [ctx] * b)  # captures the bucket's graph
    graph, _ = runner.graphs[runner.graph_bucket(b)]
    out = common.timeline(graph.replay)
    del runner
    torch.cuda.empty_cache()
    return out


def _brief(profile: dict) -> dict:
    return {k: v for k, v in profile.items() if k != "table"} | {"top": profile["table"][:8]}


def _stats(llm) -> dict:
    s = getattr(llm.speculator, "stats", None)
    if s is None:
        return dict(drafts=0, draft_tokens=0, accepted=0, per_position=[])
    return dict(drafts=s.drafts, draft_tokens=s.draft_tokens, accepted=s.accepted,
                per_position=list(s.accepted_per_position))  # fmt: skip


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


if __name__ == "__main__":
    sys.exit(main())
