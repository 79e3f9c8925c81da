"""``fp4moe demo``: the main job end to end on the embedded tiny model."""

from __future__ import annotations

import tempfile
from pathlib import Path


def add(sub) -> None:
    p = sub.add_parser(
        "demo",
        help="end to end on a tiny built-in model: build, quantize, inspect, measure KL",
        description=(
            "Build a tiny random qwen3_5_moe checkpoint (Qwen3.5 layout: fused experts, vision tower, MTP head), "
            "quantize it to NVFP4, inspect the result and compare it with the bf16 model in transformers."
        ),
    )
    p.add_argument("--out", help="keep the checkpoints in this directory (default: a temporary one)")
    p.add_argument(
        "--format", choices=["modelopt", "compressed-tensors"], default="modelopt", help="output format"
    )


def run(args) -> int:
    import torch

    from fp4moe.eval.reference_kl import compare_with_reference
    from fp4moe.models.tiny import write_tiny_checkpoint
    from fp4moe.quantize.inspect import inspect_checkpoint
    from fp4moe.quantize.options import QuantizeOptions
    from fp4moe.quantize.pipeline import quantize

    with tempfile.TemporaryDirectory(prefix="fp4moe-demo-") as tmp:
        root = Path(args.out) if args.out else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        src, dst = root / "tiny-bf16", root / f"tiny-nvfp4-{args.format}"
        print(f"1. building a tiny random qwen3_5_moe checkpoint in {src}")
        write_tiny_checkpoint(src)
        print("2. quantizing the routed experts to NVFP4")
        report = quantize(
            src, dst, QuantizeOptions(format=args.format, num_samples=16, seq_len=128, overwrite=True)
        )
        print(report.summary())
        print(f"   model card: {dst / 'README.md'} (the recipe also in hf_quant_config.json)")
        print("3. inspecting the result")
        print(inspect_checkpoint(dst).table())
        print("4. transformers on the dequantized NVFP4 experts vs the bf16 model (64 held-out tokens x 4)")
        from transformers import AutoTokenizer

        from fp4moe.data import corpus_text

        tok = AutoTokenizer.from_pretrained(str(src))
        ids = tok(corpus_text("heldout")[:20000])["input_ids"]
        batch = torch.tensor([ids[i * 64 : (i + 1) * 64] for i in range(4)])
        kl = compare_with_reference(dst, src, batch)
        print(
            f"   mean KL {kl.mean_kl:.5f} nats/token, max {kl.max_kl:.5f}, top-1 agreement {kl.top1_agreement:.1%}"
        )
        print(
            "5. generating from the NVFP4 checkpoint with fp4moe's engine (experts kept packed; random weights,"
        )
        print("   so the text is noise -- the point is the path: load, prefill, decode, detokenize)")
        from fp4moe.engine.front.llm import LLM
        from fp4moe.engine.request.sampler import SamplingParams

        llm = LLM(dst)
        out = llm.chat(
            [{"role": "user", "content": "What is a list comprehension?"}],
            SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
        )[0].outputs[0]
        print(f"   {len(out.token_ids)} tokens: {out.text!r}")
        if args.out:
            print(f"checkpoints kept in {root}")
    return 0
