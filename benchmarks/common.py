"""What the benchmark scripts share: the full-size model with random weights (``build_model``; NVFP4 routed experts,
bf16 rest, or a ``--quantize`` mix), a runner with caches filled at a given context (``random_runner``), the
decode step and prefill timed the way every table here times them (``time_decode``, ``decode_row``,
``time_prefill``: CUDA events, medians), the bytes a step moves (``weight_bytes``, ``step_bytes``), the device's
measured copy bandwidth and bf16 matmul peak (the rooflines), a torch-profiler kernel table, and the routed
experts' shapes with random NVFP4 weights for the kernel sweeps (``weights``, ``graph_time``)."""

from __future__ import annotations

import statistics
import time

import torch
from provenance import provenance, write_result  # noqa: F401 (every script writes its results through these)

from fp4moe.engine.loading.dummy import fill_random
from fp4moe.models.qwen3_5_moe import REAL_TEXT_CONFIG

FULL = REAL_TEXT_CONFIG  # Qwen3.5/3.6-35B-A3B text shapes


def log(*a):
    print(*a, flush=True)


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
    from fp4moe.models.qwen3_5_moe import ModelArgs, parse_groups, split
    from fp4moe.models.qwen3_5_moe_model import Qwen3_5MoeModel

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


def set_kv_scales(runner, model) -> None:
    """An fp8 runner's cache scales as the engine fixes them at start-up (``engine.loading.kv_scales``: the
    checkpoint's, else calibrated on the packaged text), calibrated once per model."""
    from fp4moe.engine.loading import kv_scales

    if not runner.kv.fp8:
        return
    if getattr(model, "_bench_kv_scales", None) is None:
        kv_scales.setup(runner, model, None, model.embed_tokens.device)
        model._bench_kv_scales = dict(runner.kv.scales)
    runner.set_kv_scales(model._bench_kv_scales)


def random_runner(model, b: int, ctx: int, kv_dtype: str, steps: int, spec_tokens: int = 0):
    """A GPU runner for ``b`` sequences at context ``ctx`` (room for ``steps`` more tokens, speculative
    rounds included), caches filled with random data."""
    from fp4moe.engine.runner.cuda_runner import CudaModelRunner

    dev = model.embed_tokens.device
    page = 64
    room = ctx + steps + 2 * spec_tokens + 8
    runner = CudaModelRunner(
        model, None, dev, kv_dtype, max_num_seqs=b, max_model_len=room + 64, num_pages=b * -(-room // page) + 1,
        page_size=page, spec_tokens=spec_tokens,
    )  # fmt: skip
    set_kv_scales(runner, model)
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


def time_prefill(model, tokens: int, breakdown: bool = False, fused: bool = True) -> dict:
    """Seconds, tok/s and TFLOP/s of one ``tokens``-token prefill through the engine's runner (its fused
    prefill; ``fused`` False: the model's modules throughout, as the CPU path runs them); ``host_s``: the
    host's time to enqueue it (close to ``seconds``: the prefill waits on Python). With ``breakdown`` also
    ``kernels`` (per-kernel device time, torch profiler, one more prefill on the same runner) and
    ``kernel_s`` (all kernels' device time)."""
    import time

    from torch.profiler import ProfilerActivity, profile

    from fp4moe.engine.reference.context import StepContext
    from fp4moe.engine.runner.cuda_runner import CudaModelRunner

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
        with profile(activities=[ProfilerActivity.CUDA]) as prof:  # kernels only: nothing counted twice
            run(tokens)
            torch.cuda.synchronize()
        kernels = _kernel_table(prof, None)
        result["kernels"] = kernels[:40]
        result["kernel_s"] = sum(r["us"] for r in kernels) / 1e6
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
            run(tokens)
            torch.cuda.synchronize()
        result["ops"] = _op_table(prof, 30)
    return result


def _op_table(prof, top: int) -> list[dict]:
    """torch ops by the device time of the kernels they launched themselves, per input shape: which
    elementwise passes, copies and concatenations an unnamed ``elementwise_kernel`` row stands for."""
    rows = []
    for ev in prof.key_averages(group_by_input_shape=True):
        t = getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0)
        if t > 0 and ev.key.startswith("aten::"):
            rows.append(dict(op=ev.key, shapes=str(ev.input_shapes)[:120], calls=ev.count, us=t))
    rows.sort(key=lambda r: -r["us"])
    return rows[:top]


def _kernel_table(prof, top: int) -> list[dict]:
    """GPU kernels (not the aten ops around them) by total device time."""
    rows = []
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t > 0 and not ev.key.startswith("aten::"):
            rows.append(dict(kernel=ev.key[:90], calls=ev.count, us=t))
    rows.sort(key=lambda r: -r["us"])
    return rows[:top] if top else rows


def timeline(fn, repeats: int = 5, top: int = 30) -> dict:
    """Where ``repeats`` calls of ``fn`` (e.g. graph replays) spend the GPU's time, from a profiler trace:
    per call, the span from the first kernel's start to the last one's end, the busy time (the union of
    kernel intervals, so overlapping side-stream work counts once), the kernel count, and the kernels by
    device time (us per call)."""
    import json
    import os
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    finally:
        os.unlink(path)
    kernels = sorted(
        (e["ts"], e["ts"] + e["dur"], e["name"]) for e in events if e.get("cat") == "kernel" and "dur" in e
    )
    if not kernels:
        return dict(span_us=None, busy_us=None, kernels=0, table=[])
    busy, end = 0.0, kernels[0][0]
    for start, stop, _ in kernels:
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    by_name: dict[str, list[float]] = {}
    for start, stop, name in kernels:
        by_name.setdefault(name[:90], []).append(stop - start)
    table = sorted(
        (dict(kernel=k, calls=len(v) / repeats, us=sum(v) / repeats) for k, v in by_name.items()),
        key=lambda r: -r["us"],
    )
    return dict(
        span_us=(kernels[-1][1] - kernels[0][0]) / repeats,  # includes the gaps between calls
        busy_us=busy / repeats,
        kernel_us=sum(stop - start for start, stop, _ in kernels) / repeats,
        kernels=len(kernels) / repeats,
        table=table[:top] if top else table,
    )


def kernel_breakdown(model, b: int = 1, ctx: int = 1024) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    from fp4moe.engine.runner.cuda_runner import CudaModelRunner

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


# ---- the routed experts at full size (kernel sweeps) ----

E, H, I, K = 256, 2048, 512, 8


LAYERS = 40


GU_BYTES = 2 * I * H // 2 + 2 * I * H // 16  # one expert's packed codes + block scales


DN_BYTES = H * I // 2 + H * I // 16


def graph_time(fn, reps: int = 20, layers: int = LAYERS) -> float:
    """Seconds per launch of ``fn`` (which runs ``layers`` launches), from graph replays (a single timed call
    without a GPU: a smoke test of the sweep under Triton's interpreter)."""
    fn()
    if not torch.cuda.is_available():
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) / layers
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    return statistics.median(event_seconds(g.replay, reps)) / layers


def weights(dev, layers: int = LAYERS):
    """``layers`` layers' random NVFP4 experts: {"gu": (packed, block scales, decode), "dn": (...)}."""

    def fp8(*shape):
        return (torch.rand(*shape, device=dev) + 0.5).to(torch.float8_e4m3fn)

    out = []
    for _ in range(layers):
        out.append(
            dict(
                gu=(
                    torch.randint(0, 256, (E, 2 * I, H // 2), dtype=torch.uint8, device=dev),
                    fp8(E, 2 * I, H // 16),
                    torch.full((E, 2), 2e-3, device=dev),
                ),
                dn=(
                    torch.randint(0, 256, (E, H, I // 2), dtype=torch.uint8, device=dev),
                    fp8(E, H, I // 16),
                    torch.full((E,), 2e-3, device=dev),
                ),
            )
        )
    return out
