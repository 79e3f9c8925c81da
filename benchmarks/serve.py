"""Served throughput at full size (issue 20): ``fp4moe serve`` on the full-size model through an OpenAI-style
client, beside the engine's own decode-step rate and offline ``LLM.generate`` on the same shapes, same run.

    python benchmarks/serve.py --spec off --engine-rate --offline --profile 64 --out $OUT/serve
    python benchmarks/serve.py --spec forced rejected --out $OUT/serve     # speculation (k = 2)

1. For each ``--spec`` mode, ``fp4moe serve qwen3.6-35b-a3b-nvfp4 --load-format dummy --device cuda`` starts
   in a subprocess (``off``: --num-speculative-tokens 0; ``forced``: k = 2 with each draft accepted with
   probability 0.8 (FP4MOE_FORCE_ACCEPTANCE, the fused round's benchmark switch; ``forced-vocab``: the same,
   the MTP head drafting from a 32,768-id draft vocabulary); ``rejected``: k = 2 with the
   random MTP head, whose drafts are all but never accepted). Its start-up time is recorded.
2. ``fp4moe bench``'s client (streaming /v1/completions, usage from the server) runs the reference card's sweep:
   pp 512, tg 128 at concurrency ``--concurrency`` (1 4 8 16 32 48 64), then pp 8192 tg 128 at 1, and with
   ``--sglang`` SGLang's shape (pp 8192, tg 1024 at 1 and 16), with ``--decode-rows`` the decode-dominated
   shape (pp 128, tg 1024) at every concurrency, with ``--context-rows L ...`` decode at context L
   (pp L, tg ``--context-tg``) at ``--context-concurrency`` (1 16 64): each row's steady decode rate is the
   batch's tokens/s while all its requests decode (``fp4moe bench``'s window), the served counterpart of the
   engine's decode step at that batch and context. ``--profile C``: py-spy samples the server
   process (all threads, 100 Hz) during the sweep's round at concurrency C; the top functions by own and
   inclusive samples go into the result. Before the server stops, its count of Triton kernels compiled
   after the warm-up (``/metrics``; each one a request that waited for the compiler) is recorded.
3. ``--engine-rate``: after the server stops, the engine's decode step at each batch size (graph replay and
   the engine's own step with its host work, ``decode.py``'s ``time_decode``) at context pp + tg/2.
4. ``--offline``: ``LLM.generate`` on the same dummy model with the same limits (max 64 sequences, chunked
   prefill budget, KV cache dtype and prefill graphs as served), warmed up as the server is, each
   concurrency's requests as one call: the bench client's prompts (about pp tokens), tg tokens each, greedy,
   ignore_eos --
   served ÷ offline is the serving path's own cost. ``--spec`` with no mode runs only this.

Everything goes to ``--out``/serve.json (and a markdown table on stdout).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch
from provenance import write_result

HERE = Path(__file__).parent
DECODE_SHAPE = (128, 1024)  # the issue's decode-dominated target shape (pp, tg)
SPEC = {"off": ("0", None), "forced": ("2", "0.8"), "rejected": ("2", None), "forced-vocab": ("2", "0.8")}
# modes whose MTP head drafts from a draft vocabulary (--speculative-draft-vocab): the 32,768 lowest ids
DRAFT_VOCAB = {"forced-vocab": 32768}
# a mode is a SPEC name, or one with "-process": the engine loop in its own process (--engine-process)
# instead of a thread of the server's
MODES = [*SPEC, *(f"{s}-process" for s in SPEC)]


def log(*a):
    print(*a, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, spec: str, args, port: int) -> tuple[subprocess.Popen, float]:
    k, rate = SPEC[spec.removesuffix("-process")]
    env = dict(os.environ)
    if args.step_trace:
        env["FP4MOE_STEP_TRACE"] = str(args.out / f"steps-{spec}.jsonl")
    if rate:
        env["FP4MOE_FORCE_ACCEPTANCE"] = rate
    if args.engine == "vllm":  # stock vLLM through fp4moe's recipe printer, in its own environment
        if rate:
            raise SystemExit("--spec forced is fp4moe's benchmark switch; vLLM runs off or rejected")
        serve = ["python3", "-m", "fp4moe.cli", "serve", model, "--engine", "vllm", "--exec", "--load-format", "dummy",
                 "--port", str(port), "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(args.max_model_len),
                 "--num-speculative-tokens", k, "--tensor-parallel-size", str(args.tensor_parallel_size),
                 "--enable-expert-parallel" if args.expert_parallel else "--no-enable-expert-parallel"]  # fmt: skip
        script = f"unset PYTHONPATH; . {args.vllm_site}/vllm-env.sh; export PYTHONPATH=$PYTHONPATH:{HERE.parent / 'src'}; exec "
        cmd = ["bash", "-c", script + " ".join(serve)]
        return _wait_for(cmd, env, port, spec, args)
    cmd = [
        sys.executable,
        "-m",
        "fp4moe.cli",
        "serve",
        model,
        "--load-format",
        "dummy",
        "--device",
        args.device,
    ]
    cmd += [
        "--port",
        str(port),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-model-len",
        str(args.max_model_len),
    ]
    cmd += ["--num-speculative-tokens", k]
    if spec.removesuffix("-process") in DRAFT_VOCAB:
        cmd += ["--speculative-draft-vocab", str(DRAFT_VOCAB[spec.removesuffix("-process")])]
    if spec.endswith("-process"):
        cmd += ["--engine-process"]
    if args.max_num_batched_tokens:
        cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    cmd += ["--kv-cache-dtype", args.kv_cache_dtype]
    if args.prefill_graph_tokens:
        cmd += ["--prefill-graph-tokens", str(args.prefill_graph_tokens)]
    return _wait_for(cmd, env, port, spec, args)


def _wait_for(cmd: list[str], env: dict, port: int, spec: str, args) -> tuple[subprocess.Popen, float]:
    log("$", " ".join(cmd))
    t0 = time.monotonic()
    with open(args.out / f"server-{spec}.log", "w") as errors:  # the child keeps its own descriptor
        # vLLM logs its settings (KV cache size, graph captures, compile times) to stdout; ours, an access
        # line per request
        stdout = errors if args.engine == "vllm" else subprocess.DEVNULL
        proc = subprocess.Popen(cmd, env=env, stdout=stdout, stderr=errors)
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc, time.monotonic() - t0
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() - t0 > 600:
            raise RuntimeError(f"the server did not start; see {args.out / f'server-{spec}.log'}")
        time.sleep(0.5)


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def bench(
    port: int,
    pp: int,
    tg: int,
    concurrency: list[int],
    runs: int,
    profile_at: int | None,
    pid: int,
    out: Path,
):
    """Rows of fp4moe bench's summary; with ``profile_at`` py-spy records the server during that concurrency."""
    from fp4moe.bench.client import BenchConfig, run_bench, summarize
    from fp4moe.data import corpus_text

    rows, profile = [], None
    for c in concurrency:
        window_start = time.monotonic()
        cfg = BenchConfig(
            base_url=f"http://127.0.0.1:{port}/v1", pp=[pp], tg=[tg], concurrency=[c], runs=runs, warmup=1,
            prompt_text=corpus_text("heldout"), timeout=900,
        )  # fmt: skip
        spies = []
        if profile_at == c:  # one py-spy per process: the server and its engine process, if any
            for p in [pid, *_children(pid)]:
                raw = out / f"py-spy-c{c}-{p}.txt"
                spies.append((p, raw, subprocess.Popen(
                    ["py-spy", "record", "--pid", str(p), "--rate", "100", "--format", "raw", "--threads",
                     "--nonblocking", "--output", str(raw), "--duration", "600"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                )))  # fmt: skip
            time.sleep(1.0)
        rows += summarize(asyncio.run(run_bench(cfg)))
        rows[-1]["window"] = (window_start, time.monotonic())  # the engine's step trace within it
        profiles = {}
        for p, raw, spy in spies:
            spy.send_signal(signal.SIGINT)
            try:
                spy.wait(60)
            except subprocess.TimeoutExpired:
                spy.kill()
            profiles[p] = (
                top_functions(raw) if raw.exists() else {"error": spy.stderr.read().decode()[-2000:]}
            )
        if profiles:  # the server's own profile, the engine process's (its pid) beside it
            profile = profiles.pop(pid) | ({"children": profiles} if profiles else {})
        r = rows[-1]
        log(f"  pp {pp} tg {tg} c {c}: {r['aggregate_tps_median']:.1f} tok/s aggregate, "
            f"{r['decode_tps_per_request_median']:.1f} per request, steady {r['decode_steady_tps_median'] or 0:.0f}, "
            f"TTFT p50 {r['ttft_s_median'] * 1e3:.0f} ms, "
            f"errors {r['errors']}" + (f", acceptance {r['spec_acceptance_rate']:.1%}" if "spec_acceptance_rate" in r else "")
            + (f", backoffs {r['spec_backoffs']}, started backed off {r['spec_started_backed_off']}"
               if "spec_started_backed_off" in r else ""))  # fmt: skip
    return rows, profile


def _children(pid: int) -> list[int]:
    """The pids of a process's children that run Python (the engine process; not multiprocessing's resource
    tracker, which does nothing worth sampling)."""
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []
    found = []
    for kid in kids:
        try:
            cmdline = Path(f"/proc/{kid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"resource_tracker" not in cmdline:
            found.append(int(kid))
    return found


def server_counters(port: int) -> dict:
    """From the server's ``/metrics``: its ``fp4moe:kernel_compiles_after_warmup`` counters by kernel (each
    one a request that waited for Triton's compiler), and its engine steps, all and async-scheduled."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    compiles, steps = {}, {}
    for line in text.splitlines():
        labels, _, value = line.rpartition(" ")
        if line.startswith("fp4moe:kernel_compiles_after_warmup_total{"):
            kernel = labels.split('kernel="', 1)[1].split('"', 1)[0]
            compiles[kernel] = int(float(value))
        for name in ("engine_steps", "engine_async_steps"):
            if line.startswith(f"fp4moe:{name}_total{{"):
                steps[name] = int(float(value))
    return {"compiles_after_warmup": compiles, **steps}


def top_functions(raw: Path, top: int = 30) -> dict:
    """py-spy's raw (collapsed) stacks -> the functions with the most own and inclusive samples, per thread
    (a stack that py-spy's ``--subprocesses`` starts with its process: per process and thread)."""
    own, inclusive, threads, total = collections.Counter(), collections.Counter(), collections.Counter(), 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        head = 2 if frames[0].startswith("process ") and len(frames) > 1 else 1  # process, then thread
        total += n
        threads[";".join(frames[:head])] += n
        own[frames[-1]] += n
        for f in set(frames[head:]):
            inclusive[f] += n
    return {
        "samples": total,
        "threads": threads.most_common(),
        "own": own.most_common(top),
        "inclusive": inclusive.most_common(top),
    }


def engine_rates(batches: list[int], ctx: int) -> list[dict]:
    sys.path.insert(0, str(HERE))
    import common

    dev = torch.device("cuda")
    model = common.build_model(True, dev)
    rows = []
    for b in batches:
        t = common.time_decode(model, b, ctx, "auto")
        rows.append(
            dict(batch=b, context=ctx, replay_tok_s=b / t["replay_s"], engine_tok_s=b / t["engine_s"])
        )
        log(
            f"  engine b {b}: {rows[-1]['replay_tok_s']:.0f} tok/s replay, {rows[-1]['engine_tok_s']:.0f} engine step"
        )
    del model
    torch.cuda.empty_cache()
    return rows


def offline(model_dir: str, concurrency: list[int], pp: int, tg: int, args) -> list[dict]:
    from fp4moe.engine.front.llm import LLM
    from fp4moe.engine.request.sampler import SamplingParams

    llm = LLM(model_dir, device=args.device, load_format="dummy", max_num_seqs=args.max_num_seqs,
              max_model_len=args.max_model_len, num_speculative_tokens=0, kv_cache_dtype=args.kv_cache_dtype,
              **({"max_num_batched_tokens": args.max_num_batched_tokens} if args.max_num_batched_tokens else {}),
              **({"prefill_graph_tokens": args.prefill_graph_tokens} if args.prefill_graph_tokens else {}))  # fmt: skip
    from fp4moe.bench.client import BenchConfig, bench_prompt
    from fp4moe.data import corpus_text

    # the bench client's prompts (text of about pp tokens after a unique nonce, tokenized by the server as
    # here): exactly pp random ids each made offline steps pack 16 prompts into one 16 x 512-row prefill
    # graph where the served steps, prompts of 466-530 tokens, took 15 in two 8 x 576-row graphs
    cfg = BenchConfig(base_url="", prompt_text=corpus_text("heldout"))
    rng = random.Random(0)
    params = SamplingParams(max_tokens=tg, temperature=0, ignore_eos=True)
    # what the server does before its first request (compiles and graph captures): without it the first call
    # at each concurrency captured its graphs inside the timing (c 64 ran at 0.40x the server, H200)
    if llm.device.type == "cuda":
        log(f"  offline warm-up: {llm.warmup.run(llm.engine_config.max_num_batched_tokens):.1f} s")
    if args.step_trace:  # read by each generate's engine core, so the warm-up's steps are not in it
        os.environ["FP4MOE_STEP_TRACE"] = str(args.out / "steps-offline.jsonl")
    rows = []
    for c in concurrency:
        times = []
        window_start = time.monotonic()
        for _ in range(args.runs):
            prompts = [bench_prompt(cfg, pp, rng) for _ in range(c)]
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)  # returns after the last token reached the host
            times.append(time.perf_counter() - t0)
            assert all(len(o.outputs[0].token_ids) == tg for o in outs)
        rows.append(dict(pp=pp, tg=tg, concurrency=c, aggregate_tps_median=c * tg / statistics.median(times),
                         runs=args.runs, window=(window_start, time.monotonic())))  # fmt: skip
        log(f"  offline c {c}: {rows[-1]['aggregate_tps_median']:.1f} tok/s")
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model", default="qwen3.6-35b-a3b-nvfp4", help="a full-size name or a checkpoint directory"
    )
    p.add_argument(
        "--spec",
        nargs="*",
        default=["off"],
        choices=MODES,
        help="speculation modes to serve (off, forced, rejected; each with -process: the engine loop in its own "
        "process)",
    )
    p.add_argument(
        "--concurrency", type=int, nargs="+", default=[1, 4, 8, 16, 32, 48, 64], help="streams of the sweep"
    )
    p.add_argument("--pp", type=int, default=512, help="prompt tokens of the sweep (default 512)")
    p.add_argument("--tg", type=int, default=128, help="generated tokens of the sweep (default 128)")
    p.add_argument("--long-pp", type=int, default=8192, help="the single-stream long-prompt row (0: none)")
    p.add_argument("--sglang", action="store_true", help="also pp 8192 / tg 1024 at concurrency 1 and 16 (--runs runs each)")
    p.add_argument(
        "--decode-rows", action="store_true",
        help="also the decode-dominated shape (pp 128, tg 1024) at every --concurrency; --profile then samples "
        "that shape's round (the serving path's cost per step, beside the engine's step)",
    )  # fmt: skip
    p.add_argument(
        "--context-rows", type=int, nargs="*", default=[],
        help="decode at these contexts (pp = context, tg = --context-tg) at --context-concurrency",
    )  # fmt: skip
    p.add_argument(
        "--context-concurrency", type=int, nargs="+", default=[1, 16, 64], help="streams of --context-rows"
    )
    p.add_argument(
        "--context-tg", type=int, default=1024,
        help="tokens each context row generates: enough that its first request still decodes when its last "
        "prefill ends (a steady window exists)",
    )  # fmt: skip
    p.add_argument("--runs", type=int, default=2, help="runs per row; medians reported (default 2)")
    p.add_argument("--profile", type=int, default=None, help="py-spy the server at this concurrency")
    p.add_argument("--engine-rate", action="store_true", help="the engine's decode step at the same batches")
    p.add_argument("--offline", action="store_true", help="LLM.generate on the same shapes")
    p.add_argument(
        "--step-trace", action="store_true",
        help="record the engine's steps (FP4MOE_STEP_TRACE) served and offline; summarize each row's "
        "(benchmarks/step_trace.py): steps by kind, host time, idle time, prompts per prefilling step",
    )  # fmt: skip
    p.add_argument("--max-num-seqs", type=int, default=64, help="serve --max-num-seqs (default 64)")
    p.add_argument("--max-model-len", type=int, default=16384, help="serve --max-model-len (default 16384)")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="step budget (default: fp4moe's, 8192 on the GPU)",
    )
    p.add_argument(
        "--prefill-graph-tokens",
        type=int,
        default=None,
        help="fp4moe's rows per prefill graph at most (default: fp4moe's, the step budget up to 8192)",
    )
    p.add_argument(
        "--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
        help="fp4moe's KV cache (vLLM's recipe always runs fp8)",
    )  # fmt: skip
    p.add_argument("--device", default="cuda", help="cuda; cpu only to try the script on a tiny model")
    p.add_argument("--out", type=Path, default=Path("serve-results"), help="folder for serve.json and logs")
    p.add_argument("--engine", choices=["fp4moe", "vllm"], default="fp4moe", help="whose server to measure")
    p.add_argument("--vllm-site", default="/tmp/vllm-site", help="where scripts/vllm_join.sh installed vLLM")
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="with --engine vllm: GPUs to shard over (issue 24)",
    )
    p.add_argument(
        "--expert-parallel", action=argparse.BooleanOptionalAction, default=True,
        help="with --engine vllm and more than one GPU: whole experts per GPU (default) or each split",
    )  # fmt: skip
    args = p.parse_args()
    if args.tensor_parallel_size > 1 and args.engine != "vllm":
        p.error("--tensor-parallel-size > 1 needs --engine vllm (fp4moe's engine runs on one GPU)")
    args.out.mkdir(parents=True, exist_ok=True)
    from fp4moe.models.full_size import resolve

    model = resolve(args.model, "dummy")
    result = dict(date=datetime.date.today().isoformat(), device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu", model=args.model,
                  engine=args.engine, pp=args.pp, tg=args.tg, served={}, profile={}, startup_s={},
                  tensor_parallel_size=args.tensor_parallel_size, expert_parallel=args.expert_parallel)  # fmt: skip
    for spec in args.spec:
        log(f"serve, speculation {spec}")
        port = free_port()
        proc, startup = start_server(model, spec, args, port)
        result["startup_s"][spec] = startup
        # the server's own account of its warm-up, by phase (``LLM.warmup.phases``)
        warmup = [
            x for x in (args.out / f"server-{spec}.log").read_text().splitlines() if "warm-up took" in x
        ]
        result.setdefault("warmup", {})[spec] = warmup[0] if warmup else ""
        log(f"  started in {startup:.1f} s{'; ' + warmup[0] if warmup else ''}")
        try:
            rows, profile = bench(
                port, args.pp, args.tg, args.concurrency, args.runs,
                None if args.decode_rows else args.profile, proc.pid, args.out,
            )  # fmt: skip
            if args.decode_rows:
                decode_rows, profile = bench(
                    port, *DECODE_SHAPE, args.concurrency, args.runs, args.profile, proc.pid, args.out
                )
                rows += decode_rows
            for ctx in args.context_rows:
                rows += bench(
                    port, ctx, args.context_tg, args.context_concurrency, 1, None, proc.pid, args.out
                )[0]
            if args.long_pp:  # the first long prompt of a server's life pays its first-sight costs: 3 runs
                runs = max(3, args.runs)
                rows += bench(port, args.long_pp, args.tg, [1], runs, None, proc.pid, args.out)[0]
            if args.sglang:
                rows += bench(port, 8192, 1024, [1, 16], args.runs, None, proc.pid, args.out)[0]
            counters = server_counters(port) if args.engine == "fp4moe" else {"compiles_after_warmup": {}}
        finally:
            stop_server(proc)
        result["served"][spec] = rows
        compiled = counters.pop("compiles_after_warmup")
        result.setdefault("compiles_after_warmup", {})[spec] = compiled
        result.setdefault("engine_steps", {})[spec] = counters
        log(f"  kernels compiled after the warm-up: {compiled or 'none'}; engine steps: {counters}")
        if profile:
            result["profile"][spec] = profile
        write_result(args.out / "serve.json", result, repeats=args.runs)
    if args.engine_rate:
        log("engine decode step")
        result["engine_rate"] = engine_rates(args.concurrency, args.pp + args.tg // 2)
    if args.offline:
        log("offline LLM.generate")
        result["offline"] = offline(model, args.concurrency, args.pp, args.tg, args)
    if args.step_trace:
        result["step_trace"] = step_traces(result, args.out)
    write_result(args.out / "serve.json", result, repeats=args.runs)
    table(result)
    return 0


def step_traces(result: dict, out: Path) -> dict:
    """Each row's steps, served (per speculation mode) and offline, summarized; printed side by side. A
    served row's window holds its warm-up round and its runs, an offline row's its runs."""
    import step_trace

    summaries = {}
    sources = [
        (f"served {spec}", out / f"steps-{spec}.jsonl", rows) for spec, rows in result["served"].items()
    ]
    sources.append(("offline", out / "steps-offline.jsonl", result.get("offline", [])))
    for name, path, rows in sources:
        if not path.exists():
            continue
        for r in rows:
            if "window" not in r:
                continue
            start, end = r["window"]
            s = step_trace.summary(step_trace.read(path, start, end), start, end)
            key = f"{name} pp {r['pp']} tg {r['tg']} c {r['concurrency']}"
            summaries[key] = s
            log(step_trace.format_summary(key, s))
    return summaries


def table(result: dict) -> None:
    engine = {r["batch"]: r for r in result.get("engine_rate", [])}
    offline_rows = {r["concurrency"]: r for r in result.get("offline", [])}
    log("\n| spec | pp | tg | concurrency | served tok/s | per request tok/s | steady decode tok/s | TTFT p50 ms | "
        "acceptance | engine step tok/s | served ÷ engine | offline tok/s | served ÷ offline |")  # fmt: skip
    log("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for spec, rows in result["served"].items():
        for r in rows:
            c, tps = r["concurrency"], r["aggregate_tps_median"]
            same_shape = r["pp"] == result.get("pp", 512) and r["tg"] == result.get("tg", 128)
            # the engine's step at context pp + tg / 2 stands for both the card's and the decode shape's
            # decode (576 vs 640 tokens of context: the step's cost barely moves)
            decode_shape = (r["pp"], r["tg"]) == DECODE_SHAPE
            e = engine.get(c) if same_shape or decode_shape else None
            o = offline_rows.get(c) if same_shape else None
            steady = r.get("decode_steady_tps_median")
            cells = [spec, r["pp"], r["tg"], c, f"{tps:.0f}", f"{r['decode_tps_per_request_median']:.1f}",
                     f"{steady:.0f}" if steady else "-",
                     f"{r['ttft_s_median'] * 1e3:.0f}", f"{r['spec_acceptance_rate']:.1%}" if "spec_acceptance_rate" in r else "-",
                     f"{e['engine_tok_s']:.0f}" if e else "-", f"{tps / e['engine_tok_s']:.2f}" if e else "-",
                     f"{o['aggregate_tps_median']:.0f}" if o else "-", f"{tps / o['aggregate_tps_median']:.2f}" if o else "-"]  # fmt: skip
            log("| " + " | ".join(str(x) for x in cells) + " |")


if __name__ == "__main__":
    raise SystemExit(main())
