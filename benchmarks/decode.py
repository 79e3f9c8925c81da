"""GPU engine benchmark (issue 4): decode tok/s vs the memory-bandwidth roofline, prefill vs tensor-core peak.

    python benchmarks/decode.py --out results.json            # on one GPU (the H200)

1. Correctness gate: a tiny random qwen3_5_moe (bf16, and its NVFP4 quantization; bf16 and fp8 KV) generates
   greedily on the CPU reference path and on the GPU engine (paged cache, fused kernels, CUDA graphs): tokens
   must agree up to a near tie of the reference (top-2 margin < 0.1 nats) and the chosen tokens' logprobs
   within 0.2 nats (bf16 noise; measured up to 0.11), else the script stops (fp4moe.engine.compare).
2. The full-size Qwen3.5-35B-A3B text model with random weights built on the GPU (routed experts NVFP4,
   the rest bf16; and all-bf16 for comparison).
3. Decode steps at batch B and context C (each sequence its own slot, pages and context; caches filled
   with random data -- step time does not depend on the values): median step time over graph replays
   (kernels only) and over engine steps (host work included), tok/s, bytes the step must move, GB/s and
   % of the roofline. Bytes: every non-expert weight once (embedding: B rows), the distinct experts the
   step touches (expected number under uniform routing: E(1-(1-k/E)^B) per layer), keys/values of every
   context token, and the Gated DeltaNet states read and written. Roofline = bytes / measured copy bandwidth.
4. Prefill of one 8K prompt: TFLOP/s (2 x active weights x tokens + causal attention) vs measured bf16 peak.
5. A per-kernel breakdown of one batch-1 decode step and of the prefills (torch profiler), after every timing:
   a profiler session slowed the graph replays timed after it in the same process.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from fp4moe.engine.dummy import fill_random
from fp4moe.models.qwen3_5_moe import REAL_TEXT_CONFIG

FULL = REAL_TEXT_CONFIG  # Qwen3.5/3.6-35B-A3B text shapes


def log(*a):
    print(*a, flush=True)


# ---- 1. correctness gate ------------------------------------------------------------------------------


def correctness_gate() -> dict:
    from fp4moe.engine.compare import RouterMargins, greedy_agreement
    from fp4moe.engine.llm import LLM
    from fp4moe.engine.sampler import SamplingParams
    from fp4moe.models.tiny import TinySpec, write_tiny_checkpoint
    from fp4moe.quantize.pipeline import QuantizeOptions, quantize

    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        # expert intermediate 64: the tensor-core expert GEMVs take K in multiples of 64 (nvfp4_mma_gemv), and
        # the five prompts decode together (5 tokens a step: past the one-token GEMVs)
        src = write_tiny_checkpoint(Path(tmp) / "bf16", spec=TinySpec(moe_intermediate_size=64))
        dst = Path(tmp) / "nvfp4"
        quantize(src, dst, QuantizeOptions(num_samples=8, seq_len=64, overwrite=True))
        gen = torch.Generator().manual_seed(0)
        prompts = [
            {"prompt_token_ids": torch.randint(0, 1000, (n,), generator=gen).tolist()}
            for n in (1, 7, 60, 130, 33)
        ]
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
        for name, path in (("bf16", src), ("nvfp4", dst)):
            for kv in ("auto", "fp8"):
                # the reference one prompt at a time, recording its router near ties per forward
                cpu_llm = LLM(path, dtype="bfloat16", device="cpu", kv_cache_dtype=kv)
                ref, margins = [], []
                for prompt in prompts:
                    with RouterMargins(len(cpu_llm.model.layers)) as rm:
                        ref += cpu_llm.generate([prompt], params)
                    margins.append(rm.forwards)
                gpu_llm = LLM(
                    path,
                    dtype="bfloat16",
                    device="cuda",
                    kv_cache_dtype=kv,
                    max_num_seqs=8,
                    max_model_len=1024,
                )
                got = gpu_llm.generate(prompts, params)
                agree = greedy_agreement(ref, got, router_margins=margins)
                # and one prompt alone: batch 1 takes the one-row kernels (GEMVs, their early starts) and
                # the batch-1 graph, the path of the headline number
                one = greedy_agreement(
                    [ref[2]], gpu_llm.generate([prompts[2]], params), router_margins=[margins[2]]
                )
                graphs = sorted(gpu_llm.runner.graphs)
                result[f"{name}/{kv}"] = dict(vars(agree), graphs=graphs, batch1=vars(one))
                log(f"gate {name:5s} kv={kv:4s}: {agree}; batch 1: {one}; graphs {graphs}")
                if not agree.ok or not one.ok or 1 not in graphs:
                    raise SystemExit(f"correctness gate failed for {name}/{kv}: {result[f'{name}/{kv}']}")
    return result


# ---- 2. full-size synthetic model -----------------------------------------------------------------------


ENGINE_GROUPS = {  # --quantize group -> the engine's Linear modules (per decoder layer; lm_head: top level)
    "attention": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"],
    "deltanet": ["linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.out_proj"],
    "shared": ["mlp.shared_gate_proj", "mlp.shared_up_proj", "mlp.shared_down_proj"],
    "lm_head": ["lm_head"],
}


def build_model(quantized: bool, device, mix: str = ""):
    """The full-size model with random weights; ``quantized``: NVFP4 routed experts, and ``mix`` (as
    ``fp4moe quantize --quantize``, e.g. ``attention,shared:fp8``) more groups in NVFP4 or FP8."""
    from fp4moe.layers.rope import Rotary
    from fp4moe.models.qwen3_5_moe import parse_groups, split
    from fp4moe.models.qwen3_5_moe_model import ModelArgs, Qwen3_5MoeModel

    args = ModelArgs.from_text_config(FULL)
    with torch.device("meta"):
        model = Qwen3_5MoeModel(args)
    if quantized:
        for layer in model.layers:
            layer.mlp.experts.use_nvfp4()
    for option in parse_groups(mix):
        group, algo = split(option)
        for name in ENGINE_GROUPS[group]:
            owners = [model] if group == "lm_head" else model.layers
            for owner in owners:
                if name.split(".")[0] in dict(owner.named_children()):
                    linear = owner.get_submodule(name)
                    linear.use_fp8() if algo == "fp8" else linear.use_nvfp4()
    model.to_empty(device=device)
    fill_random(model, torch.Generator(device=device).manual_seed(0))  # as --load-format dummy fills it
    model.rotary = Rotary(args.rope, device)
    return model.eval()


def add_mtp_head(model) -> None:
    """A random MTP head (one attention layer with NVFP4 experts when the model's are), as the checkpoint's."""
    from fp4moe.models.qwen3_5_moe_model import MTPHead

    device = model.embed_tokens.device
    with torch.device("meta"):
        head = MTPHead(model.args)
    if model.layers[0].mlp.experts.quantized:
        head.layer.mlp.experts.use_nvfp4()
    head.to_empty(device=device)
    fill_random(head, torch.Generator(device=device).manual_seed(1))
    model.mtp = head.eval()


def weight_bytes(model) -> tuple[int, int, int]:
    """(non-expert bytes incl. lm_head, embedding bytes, bytes of one expert across gate_up+down)."""
    experts = model.layers[0].mlp.experts
    tensors = [t for t in list(experts.parameters()) + list(experts.buffers()) if t is not None]
    per_expert = sum(t[0].numel() * t.element_size() for t in tensors if t.ndim == 3)
    total = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    expert_total = sum(
        t.numel() * t.element_size()
        for layer in model.layers
        for t in list(layer.mlp.experts.parameters()) + list(layer.mlp.experts.buffers())
    )
    embed = model.embed_tokens.numel() * model.embed_tokens.element_size()
    return total - expert_total - embed, embed, per_expert


def step_bytes(model, b: int, ctx: int, kv_elem: int) -> dict:
    a = model.args
    dense, embed, per_expert = weight_bytes(model)
    distinct = a.num_experts * (1 - (1 - a.top_k / a.num_experts) ** b)
    experts = a.num_layers * distinct * per_expert
    n_attn = sum(t == "full_attention" for t in a.layer_types)
    kv = b * (ctx + 1) * n_attn * 2 * a.num_kv_heads * a.head_dim * kv_elem
    state = (
        (a.num_layers - n_attn)
        * b
        * (
            2 * a.linear_num_value_heads * a.linear_key_head_dim * a.linear_value_head_dim * 4
            + a.conv_kernel * a.conv_dim * 2
        )
    )
    emb = b * a.hidden_size * 2
    return dict(
        weights=dense,
        experts=experts,
        kv=kv,
        states=state,
        embed=emb,
        total=dense + experts + kv + state + emb,
    )


# ---- 3. decode timing --------------------------------------------------------------------------------------


def random_runner(model, b: int, ctx: int, kv_dtype: str, steps: int, spec_tokens: int = 0):
    """A GPU runner for ``b`` sequences at context ``ctx`` (room for ``steps`` more tokens, speculative
    rounds included), caches filled with random data."""
    from fp4moe.engine.cuda_runner import CudaModelRunner

    dev = model.embed_tokens.device
    page = 64
    room = ctx + steps + 2 * spec_tokens + 8
    runner = CudaModelRunner(
        model, None, dev, kv_dtype, max_num_seqs=b, max_model_len=room + 64, num_pages=b * -(-room // page) + 1,
        page_size=page, spec_tokens=spec_tokens,
    )  # fmt: skip
    kv, st = runner.kv, runner.states
    if kv.fp8:
        kv.k.view(torch.uint8).random_(0, 0x70)
        kv.v.view(torch.uint8).random_(0, 0x70)
    else:
        kv.k.normal_()
        kv.v.normal_()
    st.rec.normal_(std=0.01)
    st.ring.normal_()
    for s in range(b):
        kv.reserve(s, room)
    return runner


def time_decode(model, b: int, ctx: int, kv_dtype: str, steps: int = 30) -> dict:
    dev = model.embed_tokens.device
    runner = random_runner(model, b, ctx, kv_dtype, steps)
    slots = list(range(b))
    tokens = torch.randint(0, model.args.vocab_size, (b,), device=dev)
    positions = [ctx] * b
    logits = runner.decode_logits(slots, tokens, positions)  # capture
    torch.cuda.synchronize()
    graph, _ = runner.graphs[next(g for g in sorted(runner.graphs) if g >= b)]
    for _ in range(3):  # warm-up replays, as tune_decode.py times them
        graph.replay()
    replay = event_seconds(graph.replay, steps)
    step = iter(range(steps))

    def engine_step(runner=runner):
        nonlocal logits, tokens
        logits = runner.decode_logits(slots, tokens, [ctx + next(step)] * b)
        tokens = logits.argmax(-1)

    engine = event_seconds(engine_step, steps)
    finite = bool(torch.isfinite(logits.float()).all())
    del engine_step, runner
    torch.cuda.empty_cache()
    return dict(replay_s=statistics.median(replay), engine_s=statistics.median(engine), finite=finite)


def decode_row(model, name: str, b: int, ctx: int, kv_dtype: str, bw: float) -> dict:
    """Time decode at batch ``b`` and context ``ctx``; the table row with bytes and roofline shares."""
    t = time_decode(model, b, ctx, kv_dtype)
    nbytes = step_bytes(model, b, ctx, 1 if kv_dtype == "fp8" else 2)
    roof = nbytes["total"] / bw
    return dict(
        model=name, kv=kv_dtype, batch=b, context=ctx, **t, bytes=nbytes,
        tok_s=b / t["engine_s"], tok_s_replay=b / t["replay_s"], gbs=nbytes["total"] / t["replay_s"] / 1e9,
        roofline_tok_s=b / roof, pct_roofline=roof / t["replay_s"], pct_roofline_engine=roof / t["engine_s"],
    )  # fmt: skip


def event_seconds(fn, repeats: int) -> list[float]:
    """Seconds of ``fn`` per call by CUDA events, each call timed on its own."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def copy_bandwidth(dev) -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    return 2 * x.numel() / statistics.median(event_seconds(lambda: y.copy_(x), 10))


def matmul_peak(dev) -> float:
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    return 2 * 8192**3 / statistics.median(event_seconds(lambda: a @ b, 10))


# ---- 4. prefill ---------------------------------------------------------------------------------------------


def time_prefill(model, tokens: int, breakdown: bool = False, fused: bool = True) -> dict:
    """Seconds, tok/s and TFLOP/s of one ``tokens``-token prefill through the engine's runner (its fused
    prefill; ``fused`` False: the model's modules throughout, as the CPU path runs them); ``host_s``: the
    host's time to enqueue it (close to ``seconds``: the prefill waits on Python). With ``breakdown`` also
    ``kernels`` (per-kernel device time, torch profiler, one more prefill on the same runner) and
    ``kernel_s`` (all kernels' device time)."""
    import time

    from torch.profiler import ProfilerActivity, profile

    from fp4moe.engine.context import StepContext
    from fp4moe.engine.cuda_runner import CudaModelRunner

    dev = model.embed_tokens.device
    runner = CudaModelRunner(
        model,
        None,
        dev,
        "auto",
        max_num_seqs=1,
        max_model_len=tokens + 64,
        num_pages=tokens // 64 + 4,
        cuda_graphs=False,
    )
    runner.fused_prefill = fused
    host = []

    def run(n):
        runner.kv.free(0)
        ids = torch.randint(0, model.args.vocab_size, (n,), device=dev)
        ctx = StepContext([n], [0], [0], runner.kv, runner.states)
        start = time.perf_counter()
        h = runner.hidden_states(ids, torch.arange(n, device=dev), ctx)
        out = model.compute_logits(h[-1:])
        host.append(time.perf_counter() - start)
        return out

    run(256)
    run(tokens)
    torch.cuda.synchronize()
    outs = []
    host.clear()
    times = event_seconds(lambda: outs.append(run(tokens)), 3)
    out = outs[-1]
    a = model.args
    dense, embed, _ = weight_bytes(model)
    lm_head = a.vocab_size * a.hidden_size * 2
    active = (dense - lm_head) / 2 + a.num_layers * a.top_k * 3 * a.hidden_size * a.moe_intermediate_size
    n_attn = sum(t == "full_attention" for t in a.layer_types)
    flops = (
        2 * active * tokens + n_attn * 2 * a.num_heads * a.head_dim * tokens * tokens
    )  # QK^T + PV, causal half
    t = statistics.median(times)
    result = dict(
        seconds=t,
        host_s=statistics.median(host),
        tokens_per_s=tokens / t,
        flops=flops,
        tflops=flops / t / 1e12,
        finite=bool(torch.isfinite(out).all()),
        fused=fused,
    )
    if breakdown:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run(tokens)
            torch.cuda.synchronize()
        kernels = _kernel_table(prof, None)
        result["kernels"] = kernels[:25]
        result["kernel_s"] = sum(r["us"] for r in kernels) / 1e6
    return result


def _kernel_table(prof, top: int) -> list[dict]:
    """GPU kernels (not the aten ops around them) by total device time."""
    rows = []
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t > 0 and not ev.key.startswith("aten::"):
            rows.append(dict(kernel=ev.key[:90], calls=ev.count, us=t))
    rows.sort(key=lambda r: -r["us"])
    return rows[:top] if top else rows


def kernel_breakdown(model, b: int = 1, ctx: int = 1024) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    from fp4moe.engine.cuda_runner import CudaModelRunner

    dev = model.embed_tokens.device
    runner = CudaModelRunner(
        model,
        None,
        dev,
        "auto",
        max_num_seqs=b,
        max_model_len=ctx + 128,
        num_pages=b * (ctx // 64 + 4) + 1,
        cuda_graphs=False,
    )
    for s in range(b):
        runner.kv.reserve(s, ctx + 2)
    runner.buf_slots[:b] = torch.arange(b, device=dev, dtype=torch.int32)
    runner.buf_pos[:b] = ctx
    runner.buf_rope[:, :b] = ctx
    # distinct random tokens: the rows route to different experts, as in time_decode (equal tokens would
    # all pick the same 8)
    runner.buf_ids[:b] = torch.randint(0, model.args.vocab_size, (b,), device=dev)
    for _ in range(3):
        runner.decode_forward(b)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        runner.decode_forward(b)
        torch.cuda.synchronize()
    del runner
    return _kernel_table(prof, 25)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="decode-results.json", help="where to write the JSON results")
    ap.add_argument("--batches", default="1,16,64", help="decode batch sizes")
    ap.add_argument("--contexts", default="1024,32768", help="decode context lengths")
    ap.add_argument(
        "--bf16-batches", default="1,16,64", help="batch sizes for the all-bf16 model (context 1K)"
    )
    ap.add_argument("--prefill", type=int, default=8192, help="prefill prompt length (0: skip)")
    ap.add_argument(
        "--mixes",
        nargs="*",
        default=[],
        help="also time these --quantize mixes (NVFP4 experts plus e.g. attention,deltanet,shared or "
        "shared:fp8) at context 1K over --batches; 'experts' alone is the reference build's mix",
    )
    ap.add_argument("--only-mixes", action="store_true", help="skip the gate and everything but --mixes")
    ap.add_argument(
        "--dequant-modes",
        default="",
        help="also time these NVFP4 dequantization modes of the expert kernels (dq.DEQUANT_MODE, "
        "e.g. 1,4) at context 1K over --batches; with --only-mixes, nothing else runs",
    )
    ap.add_argument(
        "--skip-gate", action="store_true", help="skip the correctness gate (not for reported runs)"
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    dev = torch.device("cuda")
    out = dict(
        date=datetime.date.today().isoformat(), device=torch.cuda.get_device_name(), torch=torch.__version__
    )
    if not args.skip_gate and not args.only_mixes:
        out["gate"] = correctness_gate()
    bw = copy_bandwidth(dev)
    peak = matmul_peak(dev)
    out.update(copy_bandwidth=bw, matmul_peak=peak)
    log(f"copy bandwidth {bw / 1e12:.2f} TB/s, bf16 matmul {peak / 1e12:.0f} TFLOP/s")
    rows = []
    modes = [int(m) for m in args.dequant_modes.split(",") if m]
    if modes:
        from fp4moe.kernels import nvfp4_dequant as dq

        default = dq.DEQUANT_MODE
        model = build_model(True, dev)
        for mode in modes:
            dq.DEQUANT_MODE = mode
            for b in [int(x) for x in args.batches.split(",") if x]:
                r = decode_row(model, f"nvfp4-mode{mode}", b, 1024, "auto", bw)
                rows.append(r)
                log(f"dequant mode {mode}: B={b:3d}: {r['tok_s']:8.1f} tok/s engine, {r['tok_s_replay']:8.1f} graph, "
                    f"{r['pct_roofline']:.1%} of roofline, finite {r['finite']}")  # fmt: skip
        dq.DEQUANT_MODE = default
        del model
        torch.cuda.empty_cache()
    for mix in args.mixes:
        model = build_model(True, dev, "" if mix == "experts" else mix)
        for b in [int(x) for x in args.batches.split(",") if x]:
            r = decode_row(model, f"nvfp4:{mix}", b, 1024, "auto", bw)
            rows.append(r)
            log(f"mix {mix}: B={b:3d}: {r['tok_s']:8.1f} tok/s engine, {r['tok_s_replay']:8.1f} graph, "
                f"{r['bytes']['total'] / 1e9:.2f} GB/step, {r['pct_roofline']:.1%} of roofline, finite {r['finite']}")  # fmt: skip
        del model
        torch.cuda.empty_cache()
    for quantized in (True, False) if not args.only_mixes else ():
        if not quantized and not args.bf16_batches:
            continue
        model = build_model(quantized, dev)
        name = "nvfp4" if quantized else "bf16"
        log(f"built {name} model: {torch.cuda.memory_allocated() / 2**30:.1f} GiB")
        batches = [int(x) for x in (args.batches if quantized else args.bf16_batches).split(",") if x]
        contexts = [int(x) for x in args.contexts.split(",")] if quantized else [1024]
        for kv_dtype in ("auto", "fp8") if quantized else ("auto",):
            for ctx in contexts:
                for b in batches:
                    if kv_dtype == "fp8" and ctx == 1024 and b != 1:
                        continue
                    row = decode_row(model, name, b, ctx, kv_dtype, bw)
                    rows.append(row)
                    log(
                        f"{name:5s} kv={kv_dtype:4s} B={b:3d} ctx={ctx:6d}: {row['tok_s']:8.1f} tok/s engine, "
                        f"{row['tok_s_replay']:8.1f} graph, {row['gbs']:6.0f} GB/s, {row['pct_roofline']:.1%} of roofline "
                        f"({row['roofline_tok_s']:.0f} tok/s), finite {row['finite']}"
                    )
        if args.prefill and quantized:
            for fused in (True, False):
                p = time_prefill(model, args.prefill, fused=fused)
                p["pct_peak"] = p["flops"] / p["seconds"] / peak
                key = "prefill" if fused else "prefill_modules"
                out[key] = p
                log(
                    f"{key} {args.prefill}: {p['tokens_per_s']:.0f} tok/s, {p['tflops']:.0f} TFLOP/s = "
                    f"{p['pct_peak']:.1%} of peak (host {p['host_s'] * 1e3:.0f} ms)"
                )
        del model
        torch.cuda.empty_cache()
    if not args.only_mixes:
        # the profiles last: graph replays timed after a torch.profiler session in the same process ran slower
        # (BENCHMARKS.md, issue 4), so nothing is timed after one
        model = build_model(True, dev)
        out["breakdown_b1"] = kernel_breakdown(model)
        for r in out["breakdown_b1"][:12]:
            log(f"  {r['us']:8.1f} us  x{r['calls']:3d}  {r['kernel']}")
        for fused in (True, False) if args.prefill else ():
            key = "prefill" if fused else "prefill_modules"
            p = time_prefill(model, args.prefill, breakdown=True, fused=fused)
            out["breakdown_" + key] = p["kernels"]
            out[key]["kernel_s"] = p["kernel_s"]
            log(f"{key}: kernels {p['kernel_s'] * 1e3:.0f} ms of device time")
        del model
        torch.cuda.empty_cache()
    out["decode"] = rows
    Path(args.out).write_text(json.dumps(out, indent=2, default=float))
    log(
        "\n| model | kv | batch | context | tok/s (engine) | tok/s (graph) | GB/s | roofline tok/s | % roofline |"
    )
    log("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "bytes" not in r:
            continue
        log(
            f"| {r['model']} | {r['kv']} | {r['batch']} | {r['context']} | {r['tok_s']:.0f} | {r['tok_s_replay']:.0f} | "
            f"{r['gbs']:.0f} | {r['roofline_tok_s']:.0f} | {r['pct_roofline']:.0%} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
