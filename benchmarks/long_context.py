"""Long context on one GPU (issue 22): the full-size Qwen3.5/3.6-35B-A3B shapes, random weights.

    python benchmarks/long_context.py --out results.json            # on one GPU (the H200)

1. The paged prefill attention kernel alone (``kernels.attention.paged_prefill_attention``, what a chunk after
   the first attends with): one chunk of --chunk tokens after a cached prefix of P tokens, the model's
   attention shapes (16 query heads, 2 KV heads, head dim 256), bf16 and fp8 pages: TFLOP/s against the
   measured bf16 matmul peak (FLOPs: 4 x heads x head dim x chunk x (P + chunk / 2), QK^T and PV), beside
   torch's flash attention over the same chunk as a fresh causal prompt (P = 0). ``--tiles`` sweeps tile
   shapes (rows, keys, warps, stages) at the longest prefix.
2. Chunked prefill through the engine's runner (NVFP4 experts, bf16 rest, fp8 KV cache): prompts of
   --prefill tokens in --chunk-token chunks, as a server runs them. tok/s, TFLOP/s and % of peak per length
   (FLOPs: 2 x active weights x tokens + the attention above, summed over the chunks), and the first and
   last chunk's time: a cliff at long lengths shows as a last chunk far slower than the first.
3. Decode at --decode-contexts (caches filled with random data: step time does not depend on the values),
   fp8 and bf16 KV, at batch 1, 16, 64 and the largest graph batch whose caches fit, rows that do not fit
   skipped: tok/s and % of the bandwidth roofline (``decode.py``'s bytes: weights, distinct experts, every
   cached key and value, the Gated DeltaNet states).
4. Capacity: the engine's memory plan (``CudaModelRunner``: 0.9 of the GPU after weights, states and a
   4 GiB activation reserve) for 512K-token sequences with an fp8 cache, and the arithmetic behind it.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
from functools import partial
from pathlib import Path

import torch
from provenance import write_result

sys.path.insert(0, str(Path(__file__).parent))
import common  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 16, 2, 256
log = common.log


def attention_flops(chunk: int, prefix: int, layers: int = 1) -> float:
    """QK^T and PV of ``chunk`` new rows over ``prefix`` cached keys and their own (causal) ones."""
    return layers * 4 * HEADS * HEAD_DIM * chunk * (prefix + chunk / 2)


# ---- 1. the kernel alone ------------------------------------------------------------------------------


def kernel_rows(chunk: int, prefixes: list[int], peak: float, tiles: list[tuple] | None) -> list[dict]:
    from fp4moe.engine.reference.context import StepContext
    from fp4moe.kernels import attention as attn

    dev, page = torch.device("cuda"), 64
    rows = []
    for prefix in prefixes:
        n = prefix + chunk
        pages = -(-n // page)
        table = torch.randperm(pages, device=dev, dtype=torch.int32)[None]  # scattered pages
        q = torch.randn(chunk, HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16)
        flops = attention_flops(chunk, prefix)
        for kv in ("auto", "fp8"):
            shape = (pages, page, KV_HEADS, HEAD_DIM)
            if kv == "fp8":
                k, v = (torch.randint(0, 0x70, shape, device=dev, dtype=torch.uint8) for _ in range(2))
                k, v = k.view(torch.float8_e4m3fn), v.view(torch.float8_e4m3fn)
            else:
                k, v = (torch.randn(shape, device=dev, dtype=torch.bfloat16) for _ in range(2))
            scales = torch.ones(2, device=dev)
            ctx = StepContext([chunk], [prefix], [0], None, None)
            step = ctx.tensors(dev)
            for tile in tiles if (tiles and prefix == prefixes[-1]) else [attn.PREFILL_TILES[kv == "fp8"]]:
                blocks = ctx.chunk_indices(dev, attn.prefill_tokens_per_program(HEADS // KV_HEADS, tile[0]))

                dims = (HEADS, KV_HEADS, HEAD_DIM)
                run = partial(
                    attn.paged_prefill_attention, q, k, v, table, step, blocks, scales, dims, tile=tile
                )

                try:
                    run()
                except Exception as e:  # a tile too large for shared memory
                    log(f"kernel tile {tile}: {type(e).__name__}: {str(e)[:120]}")
                    continue
                t = statistics.median(common.event_seconds(run, 5))
                rows.append(dict(kind="kernel", kv=kv, chunk=chunk, prefix=prefix, tile=list(tile), seconds=t,
                                 tflops=flops / t / 1e12, pct_peak=flops / t / peak))  # fmt: skip
                log(f"paged prefill kernel kv={kv:4s} chunk {chunk} after {prefix:7d}, tile {tile}: "
                    f"{t * 1e3:8.2f} ms, {flops / t / 1e12:6.1f} TFLOP/s = {flops / t / peak:.1%} of peak")  # fmt: skip
        del k, v, q
        torch.cuda.empty_cache()
    # torch's flash attention on a fresh causal chunk: the reference speed for P = 0
    q, k, v = (
        torch.randn(1, h, chunk, HEAD_DIM, device=dev, dtype=torch.bfloat16)
        for h in (HEADS, KV_HEADS, KV_HEADS)
    )

    def flash():
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    flash()
    t = statistics.median(common.event_seconds(flash, 5))
    flops = attention_flops(chunk, 0)
    rows.append(dict(kind="sdpa-flash", kv="auto", chunk=chunk, prefix=0, seconds=t, tflops=flops / t / 1e12,
                     pct_peak=flops / t / peak))  # fmt: skip
    log(f"torch flash attention, fresh chunk of {chunk}: {t * 1e3:.2f} ms, {flops / t / 1e12:.1f} TFLOP/s")
    return rows


# ---- 2. chunked prefill -------------------------------------------------------------------------------


def chunked_prefill(model, tokens: int, chunk: int, kv_dtype: str, peak: float, repeats: int) -> dict:
    """One ``tokens``-token prompt through the runner's module path in ``chunk``-token chunks (as the
    scheduler feeds a long prompt), each chunk timed by CUDA events; the median over ``repeats`` runs."""
    from fp4moe.engine.reference.context import StepContext
    from fp4moe.engine.runner.cuda_runner import CudaModelRunner

    dev, a = model.embed_tokens.device, model.args
    runner = CudaModelRunner(
        model, None, dev, kv_dtype, max_num_seqs=1, max_model_len=tokens + 64, num_pages=tokens // 64 + 4,
        cuda_graphs=False,
    )  # fmt: skip
    common.set_kv_scales(runner, model)
    ids = torch.randint(0, a.vocab_size, (tokens,), device=dev)

    def once() -> list[float]:
        runner.kv.free(0)
        times = []
        for start in range(0, tokens, chunk):
            n = min(chunk, tokens - start)
            ctx = StepContext([n], [start], [0], runner.kv, runner.states)

            def step(start=start, n=n, ctx=ctx):
                h = runner.hidden_states(
                    ids[start : start + n], torch.arange(start, start + n, device=dev), ctx
                )
                model.compute_logits(h[-1:])

            times += common.event_seconds(step, 1)
        return times

    once() if tokens <= 32768 else None  # compiles (the longest runs once: it is the minute-long one)
    runs = sorted((once() for _ in range(repeats)), key=sum)
    middle = runs[len(runs) // 2]  # the median run
    t = sum(middle)
    dense, _, _ = common.weight_bytes(model)
    lm_head = a.vocab_size * a.hidden_size * 2
    active = (dense - lm_head) / 2 + a.num_layers * a.top_k * 3 * a.hidden_size * a.moe_intermediate_size
    n_attn = sum(x == "full_attention" for x in a.layer_types)
    flops = 2 * active * tokens + sum(
        attention_flops(min(chunk, tokens - s), s, n_attn) for s in range(0, tokens, chunk)
    )
    runner.kv.free(0)
    return dict(kind="prefill", kv=kv_dtype, tokens=tokens, chunk=chunk, seconds=t, tokens_per_s=tokens / t,
                tflops=flops / t / 1e12, pct_peak=flops / t / peak, first_chunk_s=middle[0], last_chunk_s=middle[-1],
                chunks=len(middle), runs=repeats,
                tokens_per_s_runs=[tokens / sum(r) for r in runs], pct_peak_runs=[flops / sum(r) / peak for r in runs])  # fmt: skip


# ---- 3./4. decode and capacity ------------------------------------------------------------------------


def seq_bytes(model, ctx: int, kv_dtype: str) -> int:
    from fp4moe.engine.device.memory import kv_bytes_per_token

    return (ctx + 128) * kv_bytes_per_token(model.args, kv_dtype, torch.bfloat16)


def capacity(model, max_len: int) -> dict:
    """How many ``max_len``-token sequences the engine's own memory plan fits (fp8 cache)."""
    from fp4moe.engine.device.memory import kv_bytes_per_token
    from fp4moe.engine.runner.cuda_runner import CudaModelRunner

    free, total = torch.cuda.mem_get_info()
    runner = CudaModelRunner(model, None, model.embed_tokens.device, "fp8", max_num_seqs=32, max_model_len=max_len,
                             cuda_graphs=False)  # fmt: skip
    tokens = runner.capacity_tokens()
    per_token = kv_bytes_per_token(model.args, "fp8", torch.bfloat16)
    del runner
    torch.cuda.empty_cache()
    return dict(total_gib=total / 2**30, used_before_gib=(total - free) / 2**30, kv_bytes_per_token=per_token,
                cache_tokens=tokens, cache_gib=tokens * per_token / 2**30, max_len=max_len,
                full_sequences=tokens / max_len)  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="long-context-results.json", help="where to write the JSON results")
    ap.add_argument(
        "--chunk", type=int, default=8192, help="prefill chunk (tokens per step; vLLM's H200 default)"
    )
    ap.add_argument(
        "--kernel-prefixes", default="0,8192,32768,131072,524288", help="cached prefixes for the kernel alone"
    )
    ap.add_argument(
        "--tiles", default="", help="tile shapes to sweep at the longest prefix, 'rows,keys,warps,stages;...'"
    )
    ap.add_argument(
        "--prefill", default="8192,32768,131072,524288", help="prompt lengths to prefill (fp8 KV)"
    )
    ap.add_argument(
        "--prefill-kv", default="fp8", help="KV cache dtypes for the prefills (fp8, auto or both)"
    )
    ap.add_argument("--decode-contexts", default="1024,32768,131072,262144,524288", help="decode contexts")
    ap.add_argument("--batches", default="1,16,64", help="decode batch sizes (plus the largest that fits)")
    ap.add_argument(
        "--decode-kv", default="both", help="KV cache dtypes for the decode rows (fp8, auto or both)"
    )
    ap.add_argument("--skip", default="", help="parts to skip: kernel, prefill, decode, capacity")
    ap.add_argument(
        "--repeats", type=int, default=3,
        help="timed runs per prefill (prompts up to 128K; longer ones run once) and per decode row (each a fresh "
        "runner and graph): the median is reported, every run kept beside it (*_runs)",
    )  # fmt: skip
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    dev = torch.device("cuda")
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    skip = set(args.skip.split(","))
    out = dict(date=datetime.date.today().isoformat(), device=torch.cuda.get_device_name(), torch=torch.__version__,
               argv=sys.argv[1:])  # fmt: skip
    bw, peak = common.copy_bandwidth(dev), common.matmul_peak(dev)
    out.update(copy_bandwidth=bw, matmul_peak=peak)
    log(f"copy bandwidth {bw / 1e12:.2f} TB/s, bf16 matmul {peak / 1e12:.0f} TFLOP/s")
    rows = []
    save = lambda: write_result(args.out, out | {"rows": rows}, repeats=args.repeats)  # noqa: E731
    if "kernel" not in skip:
        tiles = [tuple(int(x) for x in t.split(",")) for t in args.tiles.split(";") if t]
        rows += kernel_rows(args.chunk, ints(args.kernel_prefixes), peak, tiles)
        save()
    model = common.build_model(True, dev)
    log(f"built the NVFP4 model: {torch.cuda.memory_allocated() / 2**30:.1f} GiB")
    if "prefill" not in skip:
        kvs = ("fp8", "auto") if args.prefill_kv == "both" else (args.prefill_kv,)
        for kv in kvs:
            for tokens in ints(args.prefill):
                r = chunked_prefill(
                    model, tokens, args.chunk, kv, peak, args.repeats if tokens <= 131072 else 1
                )
                rows.append(r)
                log(f"prefill {tokens:7d} kv={kv}: {r['tokens_per_s']:8.0f} tok/s, {r['tflops']:6.1f} TFLOP/s = "
                    f"{r['pct_peak']:.1%} of peak; chunk 1 {r['first_chunk_s'] * 1e3:.0f} ms, chunk "
                    f"{r['chunks']} {r['last_chunk_s'] * 1e3:.0f} ms")  # fmt: skip
                save()
    if "decode" not in skip:
        from fp4moe.engine.runner.cuda_runner import GRAPH_BATCH_SIZES

        for ctx in ints(args.decode_contexts):
            for kv in ("fp8", "auto") if args.decode_kv == "both" else (args.decode_kv,):
                free = torch.cuda.mem_get_info()[0] - (6 << 30)  # activations, graphs, the split buffers
                fits = [b for b in GRAPH_BATCH_SIZES if b * seq_bytes(model, ctx, kv) <= free]
                if not fits:
                    log(f"decode ctx={ctx} kv={kv}: not even one sequence fits")
                    continue
                batches = sorted({b for b in ints(args.batches) if b <= fits[-1]} | {fits[-1]})
                for b in batches:
                    runs = sorted(
                        (
                            common.decode_row(model, "nvfp4", b, ctx, kv, bw)
                            for _ in range(max(1, args.repeats))
                        ),
                        key=lambda r: r["replay_s"],
                    )
                    r = runs[len(runs) // 2]  # the median run, every run's rates beside it
                    for key in ("tok_s", "tok_s_replay", "pct_roofline"):
                        r[f"{key}_runs"] = [x[key] for x in runs]
                    r["runs"] = len(runs)
                    r["largest_that_fits"] = b == fits[-1]
                    rows.append(r)
                    log(f"decode kv={kv:4s} B={b:3d} ctx={ctx:7d}: {r['tok_s']:8.1f} tok/s engine, "
                        f"{r['tok_s_replay']:8.1f} graph, {r['pct_roofline']:.1%} of roofline, finite {r['finite']}")  # fmt: skip
                    save()
    # last: in a run on the H200 (2026-12-04) the 32K prefill's chunks took 319 ms each right after it, 182
    # ms again in a run without it (the cause was not found; the 8K prefill was not affected)
    if "capacity" not in skip:
        out["capacity"] = c = capacity(model, 524288)
        log(f"capacity: {c['cache_tokens']:,} fp8 cache tokens ({c['cache_gib']:.1f} GiB, {c['kv_bytes_per_token']} "
            f"B/token) = {c['full_sequences']:.1f} sequences of 512K")  # fmt: skip
        save()
    save()
    log("\n| part | kv | size | tok/s | TFLOP/s or % roofline |\n|---|---|---|---|---|")
    for r in rows:
        if r.get("kind") == "prefill":
            log(
                f"| prefill | {r['kv']} | {r['tokens']} | {r['tokens_per_s']:.0f} | {r['pct_peak']:.1%} of peak |"
            )
        elif "batch" in r:
            log(
                f"| decode B={r['batch']} | {r['kv']} | {r['context']} | {r['tok_s']:.0f} | {r['pct_roofline']:.0%} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
