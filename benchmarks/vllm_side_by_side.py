"""Our checkpoints in stock vLLM (issue 21): do they load, and do vLLM, fp4moe and transformers agree on them?

Stages (each a subcommand; ``benchmarks/vllm_side_by_side.sh`` runs them on the H200 in the order below):

``make DIR``      (fp4moe's environment) a synthetic qwen3_5_moe model whose dims vLLM's kernels accept
                  (hidden 512, 4 layers in the 3:1 Gated DeltaNet / gated attention pattern, 16 experts
                  top-4 of I = 128 plus a shared expert, head dims 128 as in the real model, a vision tower,
                  an MTP head; random weights, lm_head scaled so the logits are peaked, not flat) and the
                  checkpoints of the compatibility matrix written from it by ``fp4moe quantize`` (the default,
                  ``--scale-method rtn``, ``--gptq``, ``--quantize attention:fp8,deltanet:fp8,shared:fp8``,
                  ``--format compressed-tensors``) and by ``fp4moe convert`` from the default rewritten in the
                  reference build's fused layout.
``ours DIR``      (fp4moe's environment, the GPU) for each checkpoint: transformers in fp32 on the dequantized
                  weights (the reference nobody here wrote) and fp4moe's GPU engine: teacher-forced log-probs
                  of fixed windows of held-out text, greedy continuations with their logprobs, and the MTP
                  head's predicted first-draft acceptance (``fp4moe eval``'s figure).
``vllm DIR``      (vLLM's environment) each checkpoint in a fresh ``vllm.LLM`` (eager, bf16 activations,
                  ``enable_weights_track`` so a parameter that received no tensor fails the load): prompt
                  log-probs of the same windows and the same greedy continuations.
``train DIR``     (fp4moe's environment, the GPU) the MTP check's model: the trained reference recipe with
                  experts 128 wide (Marlin's tiles), ``fp4moe quantize``-d -> DIR/trained.
``mtp-vllm CKPT`` (vLLM's environment) MTP speculation (k = 2) in vLLM on held-out prompts: its greedy tokens
                  and its speculative-decoding counters.
``mtp-ours CKPT`` (fp4moe's environment) our eval's predicted first-draft acceptance on vLLM's own tokens
                  against vLLM's measured one (within MTP_SLACK), and fp4moe's own speculation beside them.
``report DIR``    the matrix: loads, greedy agreement (first split accepted only at a near tie of the
                  reference, ``engine.reference.compare``), chosen-token |Δ logprob| of vLLM and of fp4moe against
                  transformers (median and p99 over every teacher-forced position) and the top-1 agreement.

Tolerances: vLLM and fp4moe compute in bf16, the reference in fp32 on the same dequantized weights, so each
engine's distance from the reference on the bf16 source itself (the ``bf16`` row) is its noise floor. A
quantized checkpoint passes in an engine when its median chosen-token |Δ logprob| stays within
1.5 × that floor + 0.02 nats and its top-1 agreement within 3 points of it (a wrong scale or a mis-mapped
tensor moves logprobs by whole nats and top-1 by tens of points). Greedy continuations are reported (tokens
equal before the first split, splits at a reference near tie < 0.05 nats apart) but not judged: bf16 noise
may split them anywhere the two best tokens are close.

FP8 linears (``--quantize GROUP:fp8``, ModelOpt FP8 with static input scales) run W8A8 in vLLM, weight-only in
fp4moe; vLLM is judged against transformers with each FP8 linear's input quantized to E4M3 by its scale.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from provenance import write_result

VARIANTS = {  # name -> fp4moe quantize options (QuantizeOptions fields); "converted" is made from "default"
    "bf16": None,  # the source itself: each engine's bf16 noise against the fp32 reference, the yardstick
    "default": {},
    "rtn": {"scale_method": "rtn"},
    "gptq": {"gptq": True},
    "fp8-mix": {"quantize_extra": ("attention:fp8", "deltanet:fp8", "shared:fp8")},
    "compressed-tensors": {"format": "compressed-tensors"},
    "converted": None,
}
WINDOWS, WINDOW_LEN, GEN_PROMPT_LEN, GEN_TOKENS = 4, 256, 64, 32
# the MTP check: greedy continuations of held-out prompts with k drafts per round; vLLM's first-draft acceptance
# must lie within MTP_SLACK of the rate our eval predicts on the same tokens (teacher-forced). Its spread: ~1,500
# first drafts give a binomial standard error of ~1.3 points; bf16 near ties move a few drafts either way.
MTP_PROMPTS, MTP_PROMPT_LEN, MTP_TOKENS, MTP_K, MTP_SLACK = 16, 64, 256, 2, 0.05
NOISE_FACTOR, NOISE_SLACK, TOP1_SLACK, TIE = 1.5, 0.02, 0.03, 0.05


def log(*a):
    print(*a, flush=True)


def spec():
    from fp4moe.models.tiny import TinySpec

    return TinySpec(
        hidden_size=512,
        num_layers=4,
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=128,
        vocab_size=8192,
        tokenizer_vocab=8000,
        init_std=0.03,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_head_dim=128,
        mrope_section=(6, 5, 5),  # 128 * 0.25 / 2 rotary frequencies
    )


def cmd_make(args) -> None:
    from fp4moe.formats.checkpoint import CheckpointReader, ShardedWriter
    from fp4moe.models.tiny import (
        CheckpointLayout,
        build_state,
        special_ids,
        tiny_config,
        train_tokenizer,
        write_checkpoint,
    )
    from fp4moe.quantize.convert import convert, fuse_experts
    from fp4moe.quantize.options import QuantizeOptions
    from fp4moe.quantize.pipeline import quantize

    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    s = spec()
    tok = train_tokenizer(s.tokenizer_vocab)
    config = tiny_config(s, special_ids(tok))
    v = config.vision_config  # head dim 64: vLLM's vision attention backends take it
    v.hidden_size, v.intermediate_size, v.num_heads = 128, 256, 2
    state = build_state(s, config)
    state["lm_head.weight"] = state["lm_head.weight"] * 3  # peaked logits: fewer near ties to excuse
    src = write_checkpoint(root / "bf16", config, state, tok, s, CheckpointLayout.QWEN3_5, 50 << 20)
    log(f"bf16 source: {src}")
    calib = dict(num_samples=32, seq_len=256, progress=False, overwrite=True)
    for name, options in VARIANTS.items():
        if options is None:  # bf16 is the source, converted is made below
            continue
        t0 = time.perf_counter()
        quantize(src, root / name, QuantizeOptions(**{**calib, **options}))
        log(f"{name}: quantized in {time.perf_counter() - t0:.1f} s")
    fused = root / "fused"  # the reference build's layout, then back through fp4moe convert
    shutil.rmtree(fused, ignore_errors=True)
    shutil.copytree(root / "default", fused, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    reader = CheckpointReader(root / "default")
    tensors = fuse_experts({n: reader.get(n) for n in reader.names()}, s.num_layers, s.num_experts)
    writer = ShardedWriter(fused, max_shard_bytes=50 << 20)
    for n in sorted(tensors):
        writer.add(n, tensors[n])
    writer.close()
    report = convert(fused, root / "converted", overwrite=True, progress=False)
    log(f"converted: {report.experts_converted} experts, re-quantized {report.experts_requantized}")


def prompts(path: Path) -> tuple[list[list[int]], list[list[int]]]:
    """(teacher-forced windows, generation prompts) of the packaged held-out text, same for every engine."""
    from transformers import AutoTokenizer

    from fp4moe.data import corpus_text

    ids = AutoTokenizer.from_pretrained(str(path))(corpus_text("heldout"))["input_ids"]
    windows = [ids[i * WINDOW_LEN : (i + 1) * WINDOW_LEN] for i in range(WINDOWS)]
    base = WINDOWS * WINDOW_LEN
    gen = [ids[base + i * GEN_PROMPT_LEN : base + (i + 1) * GEN_PROMPT_LEN] for i in range(WINDOWS)]
    return windows, gen


ONLY: list[str] = []  # --only: a subset of the checkpoints


def checkpoints(root: Path) -> list[str]:
    return [n for n in VARIANTS if (root / n / "config.json").exists() and (not ONLY or n in ONLY)]


def fp8_input_scales(path: Path) -> dict:
    """Module name -> static input scale of each per-tensor FP8 linear (``--quantize GROUP:fp8``)."""
    from fp4moe.formats.checkpoint import CheckpointReader

    r = CheckpointReader(path)
    return {
        n.removesuffix(".input_scale"): r.get(n).float()
        for n in r.names()
        if n.endswith(".input_scale") and r.infos[n.removesuffix("input_scale") + "weight"].dtype == "F8_E4M3"
    }


def w8a8_hooks(model, scales: dict) -> list:
    """Quantize each FP8 linear's input to E4M3 with its static scale (saturating), as vLLM's W8A8 ModelOpt FP8
    path does: vLLM runs these checkpoints W8A8, fp4moe weight-only, so vLLM is judged against this."""
    import torch

    def hook(scale):
        def pre(module, args):
            x = args[0]
            s = scale.to(x.device)
            q = (x.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s
            return (q.to(x.dtype), *args[1:])

        return pre

    return [m.register_forward_pre_hook(hook(scales[n])) for n, m in model.named_modules() if n in scales]


def reference(model, windows, gen, dev, prefix: str) -> dict:
    """transformers' teacher-forced chosen-token logprobs, top-1 and top-2 margins, and greedy continuations."""
    import torch
    import torch.nn.functional as F

    out = {}
    with torch.no_grad():
        lp = [
            F.log_softmax(model(input_ids=torch.tensor([w], device=dev)).logits[0].float(), -1)
            for w in windows
        ]
        out[f"{prefix}chosen"] = [
            x[:-1].gather(-1, torch.tensor(w[1:], device=dev)[:, None])[:, 0].tolist()
            for x, w in zip(lp, windows, strict=True)
        ]
        out[f"{prefix}top1"] = [x[:-1].argmax(-1).tolist() for x in lp]
        top2 = [x[:-1].topk(2, -1).values for x in lp]
        out[f"{prefix}margin"] = [(t[:, 0] - t[:, 1]).tolist() for t in top2]
        out[f"{prefix}greedy"] = []
        for p in gen:
            ids, steps = list(p), []
            for _ in range(GEN_TOKENS):  # plain argmax loop: transformers' own forward, no cache tricks
                lps = F.log_softmax(
                    model(input_ids=torch.tensor([ids], device=dev)).logits[0, -1].float(), -1
                )
                t2 = lps.topk(2)
                steps.append([int(t2.indices[0]), float(t2.values[0]), float(t2.values[0] - t2.values[1])])
                ids.append(int(t2.indices[0]))
            out[f"{prefix}greedy"].append(steps)
    return out


def cmd_ours(args) -> None:
    import torch

    from fp4moe.engine.front.llm import LLM
    from fp4moe.engine.request.sampler import SamplingParams
    from fp4moe.eval.quality import window_outputs
    from fp4moe.eval.reference_kl import load_reference_model
    from fp4moe.quantize.dequant import dequantized_state_dict

    root = Path(args.dir)
    windows, gen = prompts(root / "bf16")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for name in checkpoints(root):
        path = root / name
        out = {"name": name}
        # transformers, fp32, dequantized weights
        model = load_reference_model(root / "bf16")
        if name != "bf16":
            model.load_state_dict(dequantized_state_dict(path), strict=True)
        model = model.to(dev)
        out.update(reference(model, windows, gen, dev, "hf_"))
        scales = fp8_input_scales(path) if name != "bf16" else {}
        if scales:  # vLLM's semantics for FP8 linears: activations quantized too
            hooks = w8a8_hooks(model, scales)
            out.update(reference(model, windows, gen, dev, "hf_w8a8_"))
            for h in hooks:
                h.remove()
        del model
        torch.cuda.empty_cache() if dev == "cuda" else None
        # fp4moe's engine
        llm = LLM(path, device=dev, max_model_len=2048, max_num_seqs=8, gpu_memory_utilization=0.3)
        chosen, top1, drafts = [], [], []
        for w in windows:
            lps, d = window_outputs(llm, w)
            chosen.append(lps[:-1].gather(-1, torch.tensor(w[1:])[:, None])[:, 0].tolist())
            top1.append(lps[:-1].argmax(-1).tolist())
            if d is not None:
                drafts.append(
                    sum(int(a == b) for a, b in zip(d.tolist(), w[2:], strict=False)) / max(1, len(w) - 2)
                )
        out["ours_chosen"], out["ours_top1"] = chosen, top1
        out["ours_mtp_acceptance"] = statistics.mean(drafts) if drafts else None
        res = llm.generate(
            gen, SamplingParams(max_tokens=GEN_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
        )
        out["ours_greedy"] = [
            [
                [t, lp]
                for t, lp in zip(
                    r.outputs[0].token_ids, (x.logprob for x in r.outputs[0].logprobs), strict=True
                )
            ]
            for r in res
        ]
        del llm
        write_result(path / "ours.json", out, indent=None)
        log(f"{name}: transformers and fp4moe done")


def cmd_vllm_one(args) -> None:
    """One checkpoint in a fresh vLLM (a subprocess per checkpoint: vLLM's engine owns the GPU until exit)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    path = Path(args.ckpt)
    windows, gen = prompts(path.parent / "bf16")
    out = {"name": path.name}
    t0 = time.perf_counter()
    llm = LLM(
        model=str(path),
        enforce_eager=True,
        max_model_len=2048,
        max_num_seqs=8,
        gpu_memory_utilization=0.3,
        enable_prefix_caching=False,
        seed=0,
        gdn_prefill_backend=args.gdn_prefill_backend,
        model_loader_extra_config={"enable_weights_track": True},
        limit_mm_per_prompt={"image": 0, "video": 0},
    )
    out["load_s"] = time.perf_counter() - t0
    tf = llm.generate(
        [TokensPrompt(prompt_token_ids=w) for w in windows],
        SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1),
    )
    out["vllm_chosen"] = [
        [d[t].logprob for d, t in zip(r.prompt_logprobs[1:], w[1:], strict=True)]
        for r, w in zip(tf, windows, strict=True)
    ]
    out["vllm_top1"] = [
        [next(t for t, x in d.items() if x.rank == 1) for d in r.prompt_logprobs[1:]] for r in tf
    ]
    g = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in gen],
        SamplingParams(temperature=0, max_tokens=GEN_TOKENS, ignore_eos=True, logprobs=1),
    )
    out["vllm_greedy"] = [
        [[t, d[t].logprob] for t, d in zip(r.outputs[0].token_ids, r.outputs[0].logprobs, strict=True)]
        for r in g
    ]
    write_result(path / "vllm.json", out, indent=None)
    log(f"{path.name}: vLLM loaded in {out['load_s']:.1f} s and answered")


def cmd_vllm(args) -> None:
    root = Path(args.dir)
    for name in checkpoints(root):
        t0 = time.perf_counter()
        cmd = [
            sys.executable,
            __file__,
            "vllm-one",
            str(root / name),
            "--gdn-prefill-backend",
            args.gdn_prefill_backend,
        ]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        (root / name / "vllm.log").write_text(r.stdout + r.stderr)
        if r.returncode:
            errors = [
                line for line in (r.stdout + r.stderr).splitlines() if "Error" in line or "error" in line
            ]
            (root / name / "vllm.json").write_text(
                json.dumps({"name": name, "error": errors[-5:] or r.stderr[-2000:]})
            )
        log(f"{name}: vLLM rc={r.returncode} in {time.perf_counter() - t0:.0f} s")


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {
                "type": "object",
                # an enum: the structured output that forces the named call then ends within max_tokens
                # (a free string from a random model can run on past it, leaving the arguments unparsable)
                "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]}},
                "required": ["city"],
            },
        },
    }
]


def _chat(client, model) -> dict:
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Write a haiku about GPUs."}],
        max_tokens=48,
        temperature=0,
    )
    m = r.choices[0].message
    reasoning = getattr(m, "reasoning", None) or getattr(m, "reasoning_content", None)
    return {"finish_reason": r.choices[0].finish_reason, "content": m.content, "reasoning": reasoning,
            "usage": r.usage.model_dump()}  # fmt: skip


def _tool_stream(client, model) -> dict:
    """A streamed call of a named tool (the random model never chooses one itself): deltas joined per index."""
    calls, chunks = {}, 0
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=True, max_tokens=64, temperature=0,
        # thinking off: with it on, vLLM forces the call's JSON only after </think>, which the random model never
        # writes (2026-12-02: 62 chunks, all reasoning, no call)
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )  # fmt: skip
    for chunk in stream:
        chunks += 1
        for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            c = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            c["name"] += (tc.function.name or "") if tc.function else ""
            c["arguments"] += (tc.function.arguments or "") if tc.function else ""
    for c in calls.values():
        try:
            c["arguments_parse"] = json.loads(c["arguments"])
        except ValueError as e:
            c["arguments_parse"] = f"not JSON: {e}"
    return {"chunks": chunks, "calls": list(calls.values())}


def _image(client, model) -> dict:
    import base64
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 40, 40)).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    content = [
        {"type": "text", "text": "What colour is this?"},
        {"type": "image_url", "image_url": {"url": url}},
    ]
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], max_tokens=16, temperature=0
    )
    return {"finish_reason": r.choices[0].finish_reason, "usage": r.usage.model_dump()}


def _spec_metrics(client, model, base: str) -> dict:
    """A long greedy completion, then vLLM's speculative-decoding counters from /metrics."""
    import httpx

    client.completions.create(
        model=model, prompt="The Python language reference", max_tokens=512, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    metrics = httpx.get(f"{base}/metrics", timeout=10).text
    return {
        line.split(" ")[0]: float(line.split(" ")[-1])
        for line in metrics.splitlines()
        if line.startswith("vllm:spec_decode") and not line.startswith("#")
    }


def cmd_recipe(args) -> None:
    """``fp4moe serve --engine vllm --exec`` (the reference recipe: fp8 KV, YaRN, MTP n = 2, reasoning and tool
    parsers, prefix caching) on one checkpoint, asked through the ``openai`` client: a chat request, a streamed
    tool call, an image request, then a long greedy completion for MTP's acceptance counters; each step's
    failure is recorded and the next still runs. Runs in vLLM's environment (fp4moe's ``src`` on the path)."""
    import os
    import socket

    import httpx
    import openai

    ckpt = Path(args.ckpt)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "fp4moe.cli",
        "serve",
        str(ckpt),
        "--engine",
        "vllm",
        "--exec",
        "--port",
        str(port),
    ]
    out = {"checkpoint": ckpt.name}
    out["command"] = subprocess.run(
        [c for c in cmd if c != "--exec"], capture_output=True, text=True
    ).stdout.strip()
    log("$", out["command"])
    t0 = time.monotonic()
    logf = open(ckpt / "recipe-server.log", "w")  # noqa: SIM115 (the server writes to it until it stops)
    proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=dict(os.environ))
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() - t0 > args.timeout:
                raise RuntimeError(f"vLLM did not start; see {ckpt / 'recipe-server.log'}")
            time.sleep(1)
        out["startup_s"] = time.monotonic() - t0
        log(f"vLLM serving after {out['startup_s']:.0f} s")
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
        model = client.models.list().data[0].id
        steps = {"chat": _chat, "tool_call_stream": _tool_stream, "image": _image}
        steps["spec_metrics"] = lambda c, m: _spec_metrics(c, m, base)
        for name, step in steps.items():
            try:
                out[name] = step(client, model)
            except Exception as e:  # noqa: BLE001 (recorded; the next step still runs)
                out[name] = {"error": f"{type(e).__name__}: {e}"}
            log(name, json.dumps(out[name], default=str)[:2000])
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        logf.close()
        write_result(ckpt / "recipe.json", out)


def _diffs(a: list[list[float]], b: list[list[float]]) -> list[float]:
    return [abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)]


def _top1(a, b, margin) -> tuple[int, int]:
    """(agreeing positions, positions compared): a near tie of the reference (margin < TIE) is not compared."""
    pairs = [
        (x, y)
        for ra, rb, rm in zip(a, b, margin, strict=True)
        for x, y, m in zip(ra, rb, rm, strict=True)
        if m >= TIE
    ]
    return sum(x == y for x, y in pairs), len(pairs)


def _greedy(ref: list[list], got: list[list]) -> dict:
    """Token agreement of greedy continuations: walk to the first split, excused only at a reference near tie."""
    same = excused = bad = 0
    lp = []
    for r, g in zip(ref, got, strict=True):
        if len(r) != len(g):
            bad += 1
            continue
        for (rt, rlp, rmargin), (gt, glp) in zip(r, g, strict=True):
            if rt != gt:
                excused += rmargin < TIE
                bad += rmargin >= TIE
                break
            same += 1
            lp.append(abs(rlp - glp))
    return {
        "tokens_equal": same,
        "near_tie_splits": excused,
        "real_splits": bad,
        "max_dlogprob": max(lp, default=0),
    }


def _q(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(math.ceil(q * len(xs))) - 1)] if xs else float("nan")


def cmd_train(args) -> None:
    """The MTP check's model (fp4moe's environment, the GPU): ``scripts/train_reference.py``'s reference model
    (8 layers, an MTP head trained jointly for token t+2) with experts of width 128 (Marlin's tiles; the
    reference's 96 is not a multiple of 64), trained for ``--minutes`` on the packaged calibration text,
    then ``fp4moe quantize`` with its defaults -> DIR/trained. A random MTP head accepts nothing in either
    engine, which proves only that it loads; a trained one accepts at a rate the two can disagree on."""
    import fp4moe.data
    from fp4moe.quantize.options import QuantizeOptions
    from fp4moe.quantize.pipeline import quantize

    root = Path(args.dir)
    src, corpus = root / "trained-bf16", Path(fp4moe.data.__file__).parent / "pydocs-calib.txt.gz"
    script = Path(__file__).resolve().parents[1] / "scripts" / "train_reference.py"
    subprocess.run(
        [sys.executable, str(script), "--out", str(src), "--minutes", str(args.minutes),
         "--moe-intermediate-size", "128", "--corpus", str(corpus)],
        check=True,
    )  # fmt: skip
    quantize(
        src, root / "trained", QuantizeOptions(num_samples=32, seq_len=256, progress=False, overwrite=True)
    )
    log(f"trained and quantized: {root / 'trained'}")


def mtp_prompts(path: Path) -> list[list[int]]:
    """MTP_PROMPTS prompts of MTP_PROMPT_LEN held-out tokens, spread over the held-out text."""
    from transformers import AutoTokenizer

    from fp4moe.data import corpus_text

    ids = AutoTokenizer.from_pretrained(path)(corpus_text("heldout"))["input_ids"]
    step = len(ids) // MTP_PROMPTS
    return [ids[i * step : i * step + MTP_PROMPT_LEN] for i in range(MTP_PROMPTS)]


def cmd_mtp_vllm(args) -> None:
    """(vLLM's environment) the trained checkpoint with MTP speculation (k = MTP_K): greedy continuations of
    the held-out prompts and vLLM's speculative-decoding counters -> CKPT/mtp-vllm.json."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    path = Path(args.ckpt)
    prompts = mtp_prompts(path)
    llm = LLM(
        model=str(path), max_model_len=2048, max_num_seqs=MTP_PROMPTS, gpu_memory_utilization=0.3,
        enable_prefix_caching=False, seed=0, gdn_prefill_backend=args.gdn_prefill_backend,
        speculative_config={"method": "mtp", "num_speculative_tokens": MTP_K},
        limit_mm_per_prompt={"image": 0, "video": 0}, disable_log_stats=False, enforce_eager=True,
    )  # fmt: skip
    res = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts],
        SamplingParams(temperature=0, max_tokens=MTP_TOKENS, ignore_eos=True),
    )
    counters = {}
    for m in llm.get_metrics():
        if "spec_decode" in m.name:
            counters[m.name] = getattr(m, "values", None) or getattr(m, "value", None)
    out = {"prompts": prompts, "generated": [list(r.outputs[0].token_ids) for r in res], "counters": counters}
    write_result(path / "mtp-vllm.json", out, indent=None)
    log(f"vLLM MTP counters: {counters}")


def _accepted_first(counters: dict) -> tuple[float, float]:
    """(drafts, first drafts accepted) from vLLM's counters (names with or without _total)."""

    def get(suffix: str):
        return next((v for k, v in counters.items() if k.removesuffix("_total").endswith(suffix)), None)

    drafts, per_pos = get("num_drafts"), get("num_accepted_tokens_per_pos")
    first = per_pos[0] if isinstance(per_pos, list) else per_pos
    return float(drafts or 0), float(first or 0)


def cmd_mtp_ours(args) -> None:
    """(fp4moe's environment) on the tokens vLLM generated: our eval's predicted first-draft acceptance
    (teacher-forced MTP argmax against the next-but-one token, ``window_outputs``; the generated tokens are
    vLLM's greedy choices, so a match is exactly a draft vLLM's verifier would accept), fp4moe's own MTP
    speculation on the same prompts, and the verdict -> CKPT/mtp.json."""

    from fp4moe.engine.front.llm import LLM
    from fp4moe.engine.request.sampler import SamplingParams
    from fp4moe.eval.quality import window_outputs

    path = Path(args.ckpt)
    v = json.loads((path / "mtp-vllm.json").read_text())
    # the CPU, as `fp4moe eval` runs by default (a 30M-parameter model: seconds; no kernels to compile)
    llm = LLM(path, device="cpu", max_model_len=2048, max_num_seqs=MTP_PROMPTS, num_speculative_tokens=MTP_K,
              gpu_memory_utilization=0.3)  # fmt: skip
    hits = total = 0
    for prompt, gen in zip(v["prompts"], v["generated"], strict=True):
        ids = prompt + gen
        _, drafts = window_outputs(llm, ids)
        # drafts[i] predicts ids[i + 2]; score the generated part (the prompt is text, not greedy choices)
        scored = range(len(prompt) - 2, len(ids) - 2)
        hits += sum(int(drafts[i]) == ids[i + 2] for i in scored)
        total += len(scored)
    predicted = hits / total
    drafts, first = _accepted_first(v["counters"])
    vllm_rate = first / drafts if drafts else None
    ours = llm.generate(v["prompts"], SamplingParams(temperature=0, max_tokens=MTP_TOKENS, ignore_eos=True))
    st = llm.speculator.stats  # ours backs off a sequence whose drafts stop paying: its rate is over fewer
    stats = {"drafts": st.drafts, "first_draft_acceptance": st.accepted_per_position[0] / max(1, st.drafts),
             "backed_off": st.backed_off}  # fmt: skip
    same = sum(list(o.outputs[0].token_ids) == g for o, g in zip(ours, v["generated"], strict=True))
    out = {
        "predicted_first_draft_acceptance": predicted,
        "vllm_first_draft_acceptance": vllm_rate,
        "vllm_drafts": drafts,
        "ours_spec_stats": stats,
        "greedy_continuations_equal": f"{same} of {len(ours)}",
        "slack": MTP_SLACK,
        "ok": vllm_rate is not None and abs(vllm_rate - predicted) <= MTP_SLACK,
    }
    write_result(path / "mtp.json", out)
    log(json.dumps(out))


def cmd_report(args) -> dict:
    root = Path(args.dir)
    rows = []
    for name in checkpoints(root):
        ours = (
            json.loads((root / name / "ours.json").read_text())
            if (root / name / "ours.json").exists()
            else {}
        )
        vl = (
            json.loads((root / name / "vllm.json").read_text())
            if (root / name / "vllm.json").exists()
            else {}
        )
        row = {
            "checkpoint": name,
            "vllm_loads": bool(vl) and "error" not in vl,
            "vllm_error": vl.get("error"),
        }
        if ours:
            for who, key in (("ours", "ours"), ("vllm", "vllm")):
                src = ours if who == "ours" else vl
                if f"{key}_chosen" not in src:
                    continue
                ref = "hf_w8a8_" if who == "vllm" and "hf_w8a8_chosen" in ours else "hf_"
                d = _diffs(ours[f"{ref}chosen"], src[f"{key}_chosen"])
                agree, n = _top1(ours[f"{ref}top1"], src[f"{key}_top1"], ours[f"{ref}margin"])
                row[who] = {
                    "median_dlogprob": statistics.median(d),
                    "p99_dlogprob": _q(d, 0.99),
                    "max_dlogprob": max(d),
                    "top1_agreement": agree / max(1, n),
                    "greedy": _greedy(ours[f"{ref}greedy"], src[f"{key}_greedy"]),
                    "reference": "transformers, W8A8 FP8 linears" if ref == "hf_w8a8_" else "transformers",
                }
                floor = rows[0].get(who) if rows and rows[0]["checkpoint"] == "bf16" else None
                row[who]["ok"] = floor is None or (
                    row[who]["median_dlogprob"] <= NOISE_FACTOR * floor["median_dlogprob"] + NOISE_SLACK
                    and row[who]["top1_agreement"] >= floor["top1_agreement"] - TOP1_SLACK
                )
            row["mtp_predicted_acceptance"] = ours.get("ours_mtp_acceptance")
        rows.append(row)
    result = {
        "rows": rows,
        "tolerances": {
            "noise_factor": NOISE_FACTOR,
            "noise_slack": NOISE_SLACK,
            "top1_slack": TOP1_SLACK,
            "near_tie": TIE,
        },
    }
    write_result(root / "matrix.json", result)
    log(
        "| checkpoint | vLLM loads | vLLM vs transformers: median / p99 abs dlogprob, top-1, greedy tokens equal | fp4moe vs transformers: same |"
    )
    log("|---|---|---|---|")
    for r in rows:
        cells = []
        for who in ("vllm", "ours"):
            x = r.get(who)
            cells.append(
                f"{x['median_dlogprob']:.4f} / {x['p99_dlogprob']:.3f}, {100 * x['top1_agreement']:.1f}%, "
                f"{x['greedy']['tokens_equal']}/{GEN_TOKENS * WINDOWS} (splits at ties {x['greedy']['near_tie_splits']}, "
                f"elsewhere {x['greedy']['real_splits']}) {'ok' if x['ok'] else 'FAIL'}"
                if x
                else "-"
            )
        loads = "yes" if r["vllm_loads"] else f"no: {str(r['vllm_error'])[:200]}"
        log(f"| {r['checkpoint']} | {loads} | {cells[0]} | {cells[1]} |")
    return result


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True, help="what to run")
    for name in ("make", "ours", "vllm", "report"):
        p = sub.add_parser(name)
        p.add_argument("dir", help="folder of the checkpoints (made by `make`)")
        p.add_argument("--only", nargs="*", default=[], choices=list(VARIANTS), help="these checkpoints only")
        if name == "vllm":
            p.add_argument("--timeout", type=int, default=300, help="seconds per checkpoint")
            p.add_argument(
                "--gdn-prefill-backend", default="triton", help="vLLM's GDN prefill (flashinfer not carried)"
            )
    p = sub.add_parser("recipe")
    p.add_argument("ckpt", help="the checkpoint dir")
    p.add_argument("--timeout", type=int, default=420, help="seconds for vLLM to start")
    for name in ("vllm-one", "mtp-vllm"):  # one checkpoint in vLLM
        p = sub.add_parser(name)
        p.add_argument("ckpt", help="the checkpoint dir")
        p.add_argument(
            "--gdn-prefill-backend", default="triton", help="vLLM's GDN prefill (flashinfer not carried)"
        )
    p = sub.add_parser("train")
    p.add_argument("dir", help="folder of the checkpoints (made by `make`)")
    p.add_argument("--minutes", type=float, default=3.0, help="training time (default 3)")
    p = sub.add_parser("mtp-ours")
    p.add_argument("ckpt", help="the checkpoint dir")
    args = ap.parse_args(argv)
    ONLY[:] = getattr(args, "only", [])
    {
        "make": cmd_make,
        "ours": cmd_ours,
        "vllm": cmd_vllm,
        "vllm-one": cmd_vllm_one,
        "report": cmd_report,
        "recipe": cmd_recipe,
        "train": cmd_train,
        "mtp-vllm": cmd_mtp_vllm,
        "mtp-ours": cmd_mtp_ours,
    }[args.cmd](args)


if __name__ == "__main__":
    main()
