"""Quantize throughput and peak host memory on synthetic checkpoints with full-size per-layer shapes.

Each checkpoint has N decoder layers of Qwen3.5-35B-A3B's real shapes (hidden 2048, 256 experts top-8 with
I = 512 stored fused, shared expert 512, Gated DeltaNet 16/32 heads of 128, gated attention 16/2 heads of 256,
the real 3:1 layer pattern) with random bf16 weights, a small vocabulary (1024; embedding and lm_head are not
what is measured) and no vision tower. Each N runs `fp4moe quantize` in a fresh process, so the peak RSS it
reports (ru_maxrss, from the OS) is that run's alone.

    python benchmarks/quantize.py --layers 2 4 8 --workdir /tmp/fp4moe-bench [--device cuda] [--out results.json]

``--read-ahead both --repeats 3 --cold`` runs each checkpoint with the next layer read on a worker thread (the
default) and with ``--no-read-ahead``, alternating, three times each, and prints the medians; ``--cold`` drops
the checkpoint's pages from the OS page cache before every run (``posix_fadvise``), so its reads come from the
disk, as on a first run over a freshly downloaded model, not from memory.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from provenance import write_result

from fp4moe.formats.checkpoint import ShardedWriter
from fp4moe.models.qwen3_5_moe import REAL_TEXT_CONFIG
from fp4moe.models.tiny import train_tokenizer

H, E, K, I, SHARED, VOCAB = 2048, 256, 8, 512, 512, 1024
GDN_KEY_HEADS, GDN_VALUE_HEADS, GDN_DIM = 16, 32, 128
HEADS, KV_HEADS, HEAD_DIM = 16, 2, 256


def layer_types(n: int) -> list[str]:
    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]
    if "full_attention" not in types:
        types[-1] = "full_attention"
    return types


def text_config(n: int) -> dict:
    """The real text shapes with ``n`` layers, a small vocabulary and no MTP layer."""
    return {
        **REAL_TEXT_CONFIG,
        "model_type": "qwen3_5_moe_text",
        "vocab_size": VOCAB,
        "num_hidden_layers": n,
        "layer_types": layer_types(n),
        "tie_word_embeddings": False,
        "mtp_num_hidden_layers": 0,
        "eos_token_id": 2,
    }


def layer_tensors(kind: str, gen: torch.Generator) -> dict[str, torch.Tensor]:
    def w(*shape, std=0.02):
        return (torch.randn(*shape, generator=gen, device=gen.device) * std).to(torch.bfloat16).cpu()

    t = {"input_layernorm.weight": w(H, std=0.1), "post_attention_layernorm.weight": w(H, std=0.1)}
    if kind == "linear_attention":
        qkv = 2 * GDN_KEY_HEADS * GDN_DIM + GDN_VALUE_HEADS * GDN_DIM
        t |= {
            "linear_attn.in_proj_qkv.weight": w(qkv, H),
            "linear_attn.in_proj_z.weight": w(GDN_VALUE_HEADS * GDN_DIM, H),
            "linear_attn.in_proj_b.weight": w(GDN_VALUE_HEADS, H),
            "linear_attn.in_proj_a.weight": w(GDN_VALUE_HEADS, H),
            "linear_attn.conv1d.weight": w(qkv, 1, 4, std=0.3),
            "linear_attn.A_log": w(GDN_VALUE_HEADS, std=1.0),
            "linear_attn.dt_bias": w(GDN_VALUE_HEADS, std=1.0),
            "linear_attn.norm.weight": w(GDN_DIM, std=0.1) + 1,
            "linear_attn.out_proj.weight": w(H, GDN_VALUE_HEADS * GDN_DIM),
        }
    else:
        t |= {
            "self_attn.q_proj.weight": w(2 * HEADS * HEAD_DIM, H),
            "self_attn.k_proj.weight": w(KV_HEADS * HEAD_DIM, H),
            "self_attn.v_proj.weight": w(KV_HEADS * HEAD_DIM, H),
            "self_attn.o_proj.weight": w(H, HEADS * HEAD_DIM),
            "self_attn.q_norm.weight": w(HEAD_DIM, std=0.1),
            "self_attn.k_norm.weight": w(HEAD_DIM, std=0.1),
        }
    t |= {
        "mlp.gate.weight": w(E, H),
        "mlp.experts.gate_up_proj": w(E, 2 * I, H),
        "mlp.experts.down_proj": w(E, H, I),
        "mlp.shared_expert.gate_proj.weight": w(SHARED, H),
        "mlp.shared_expert.up_proj.weight": w(SHARED, H),
        "mlp.shared_expert.down_proj.weight": w(H, SHARED),
        "mlp.shared_expert_gate.weight": w(1, H),
    }
    return t


def layer_tensors_embed(gen: torch.Generator) -> torch.Tensor:
    return (torch.randn(VOCAB, H, generator=gen, device=gen.device) * 0.02).bfloat16().cpu()


def write_synthetic(path: Path, n: int, seed: int = 0) -> int:
    """Write the checkpoint one layer at a time (bounded memory); returns its size in bytes.
    Random numbers come from the GPU when there is one (only to write faster)."""
    path.mkdir(parents=True)
    gen = torch.Generator(device="cuda" if torch.cuda.is_available() else "cpu").manual_seed(seed)
    writer = ShardedWriter(path, max_shard_bytes=4 << 30)
    writer.add("model.language_model.embed_tokens.weight", layer_tensors_embed(gen))
    for i, kind in enumerate(layer_types(n)):
        for name, t in layer_tensors(kind, gen).items():
            writer.add(f"model.language_model.layers.{i}.{name}", t)
    writer.add("model.language_model.norm.weight", torch.zeros(H, dtype=torch.bfloat16))
    writer.add("lm_head.weight", layer_tensors_embed(gen))
    writer.close()
    config = {
        "model_type": "qwen3_5_moe",
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "text_config": text_config(n),
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    train_tokenizer(1000).save_pretrained(path)
    return writer.total_bytes


def evict(path: Path) -> None:
    """Drop ``path``'s files from the OS page cache (clean pages only: they were written and synced)."""
    os.sync()
    for f in path.iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def quantize_once(n: int, src: Path, workdir: Path, read_ahead: bool, args) -> dict:
    """One `fp4moe quantize` of ``src`` in a fresh process -> its report's figures."""
    dst = workdir / f"synthetic-{n}L-nvfp4"
    shutil.rmtree(dst, ignore_errors=True)
    if args.cold:
        evict(src)
    report_path = workdir / f"report-{n}L.json"
    cmd = [
        sys.executable, "-m", "fp4moe.cli", "quantize", str(src), str(dst), "--no-progress",
        "--report", str(report_path), "--num-samples", str(args.num_samples), "--seq-len", str(args.seq_len),
        "--device", args.device, "--calib-dtype", args.calib_dtype, "--batch-size", str(args.batch_size),
        "--max-shard-size", args.max_shard_size, *([] if read_ahead else ["--no-read-ahead"]),
    ]  # fmt: skip
    t = time.perf_counter()
    subprocess.run(cmd, check=True)
    wall = time.perf_counter() - t
    report = json.loads(report_path.read_text())
    shutil.rmtree(dst)
    return {
        "layers": n,
        "read_ahead": read_ahead,
        "cold": args.cold,
        "bytes_in": report["bytes_in"],
        "bytes_out": report["bytes_out"],
        "wall_s": round(wall, 1),
        "quantize_s": round(report["seconds"], 1),
        "gb_per_s": round(report["bytes_in"] / 1e9 / report["seconds"], 3),
        "peak_rss_gb": round(report["peak_rss_bytes"] / 1e9, 2),
        "stage_s": report["stage_seconds"],
        "device": report["device"],
        "calib_dtype": report["calib_dtype"],
        "calib_tokens": report["calibration_tokens"],
        "experts_calibrated": report["experts_calibrated"],
        "experts": report["experts_quantized"],
    }


def run(n: int, workdir: Path, args) -> list[dict]:
    """Write the N-layer checkpoint, quantize it ``--repeats`` times per ``--read-ahead`` mode (alternating)."""
    src = workdir / f"synthetic-{n}L"
    shutil.rmtree(src, ignore_errors=True)
    t = time.perf_counter()
    size = write_synthetic(src, n)
    gen_s = time.perf_counter() - t
    modes = {"on": [True], "off": [False], "both": [True, False]}[args.read_ahead]
    results = []
    for _ in range(args.repeats):
        for read_ahead in modes:
            result = {"generate_s": round(gen_s, 1), **quantize_once(n, src, workdir, read_ahead, args)}
            assert size == result["bytes_in"]
            print(json.dumps(result), flush=True)
            if args.out:  # append as we go, so a run cut short keeps what it measured
                with open(args.out + ".jsonl", "a") as f:
                    f.write(json.dumps(result) + "\n")
            results.append(result)
    if not args.keep:
        shutil.rmtree(src)
    return results


def medians(results: list[dict]) -> list[dict]:
    """Per (layers, read-ahead): the median time, rate and stage times, and the largest peak RSS."""
    rows = []
    for key in dict.fromkeys((r["layers"], r["read_ahead"]) for r in results):
        runs = [r for r in results if (r["layers"], r["read_ahead"]) == key]
        stages = {
            s: round(statistics.median(r["stage_s"].get(s, 0.0) for r in runs), 1) for s in runs[0]["stage_s"]
        }
        seconds = statistics.median(r["quantize_s"] for r in runs)
        rows.append({
            "layers": key[0], "read_ahead": key[1], "runs": len(runs), "median_s": seconds,
            "gb_per_s": round(runs[0]["bytes_in"] / 1e9 / seconds, 3),
            "peak_rss_gb": max(r["peak_rss_gb"] for r in runs), "median_stage_s": stages,
        })  # fmt: skip
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--layers", type=int, nargs="+", default=[2, 4, 8], help="decoder layer counts of the models (2 4 8)"
    )
    p.add_argument("--workdir", default="/tmp/fp4moe-bench", help="where the checkpoints are written")
    p.add_argument("--device", default="auto", help="quantize --device (auto: cuda when there is one)")
    p.add_argument("--calib-dtype", default="auto", help="quantize --calib-dtype")
    p.add_argument("--num-samples", type=int, default=16, help="calibration samples (default 16)")
    p.add_argument("--seq-len", type=int, default=256, help="calibration sample length (default 256)")
    p.add_argument("--batch-size", type=int, default=8, help="calibration batch size (default 8)")
    p.add_argument("--max-shard-size", default="1GB", help="1GB: every N fills the one shard buffer")
    p.add_argument(
        "--read-ahead",
        choices=["on", "off", "both"],
        default="on",
        help="quantize with the next layer read on a worker thread (on: the default), --no-read-ahead (off), or "
        "both, alternating",
    )
    p.add_argument("--repeats", type=int, default=1, help="runs per checkpoint and read-ahead mode (medians)")
    p.add_argument(
        "--cold", action="store_true", help="drop the checkpoint from the OS page cache before every run"
    )
    p.add_argument("--keep", action="store_true", help="keep the checkpoints")
    p.add_argument("--out", help="write all results as JSON here")
    args = p.parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    results = [r for n in args.layers for r in run(n, workdir, args)]
    summary = medians(results)
    for row in summary:
        print(json.dumps(row), flush=True)
    if args.out:
        write_result(args.out, {"runs": results, "medians": summary}, repeats=args.repeats)


if __name__ == "__main__":
    main()
