"""Where a GPU server's start-up goes (issue 20: "serves on one H200 in about a minute"): the full-size
dummy model built as ``fp4moe serve`` builds it, then ``LLM.warmup`` with every ``generate`` call and
every graph capture it makes timed one by one, so a phase's seconds can be traced to the lengths and
shapes that cost them (cold: Triton compiles; warm cache: the runs themselves).

    python benchmarks/startup.py --out $OUT/startup          # cold Triton cache: set TRITON_CACHE_DIR empty
    python benchmarks/startup.py --record-autotune src/fp4moe/data   # this GPU's autotuning seeds
    python benchmarks/startup.py --record-compiles src/fp4moe/data   # its Triton variants, compiled ahead
    py-spy record --format raw -o $OUT/startup.txt -- python benchmarks/startup.py   # where the host waits

Prints the load time, the phases (``LLM.warmup.phases``) and the slowest calls; writes startup.json.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from provenance import write_result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3.6-35b-a3b-nvfp4", help="a full-size name or a checkpoint dir")
    p.add_argument("--max-num-seqs", type=int, default=64, help="as serve's --max-num-seqs (default 64)")
    p.add_argument("--max-model-len", type=int, default=16384, help="as serve's (default 16384)")
    p.add_argument("--kv-cache-dtype", default="fp8", choices=["auto", "fp8"], help="KV cache (default fp8)")
    p.add_argument("--num-speculative-tokens", type=int, default=0, help="MTP drafts per step (default 0)")
    p.add_argument(
        "--prefix-caching", action="store_true", help="warm up as for a server with a prefix cache"
    )
    p.add_argument("--top", type=int, default=25, help="slowest calls to print")
    p.add_argument("--out", type=Path, default=None, help="folder for startup.json (default: none written)")
    p.add_argument(
        "--record-compiles",
        type=Path,
        default=None,
        metavar="DIR",
        help="after the warm-up, add every Triton variant it compiled for this GPU to the seed file there "
        "(kernels.compile_seeds; commit it under src/fp4moe/data: later cold starts compile them in parallel; "
        "run once per configuration served, e.g. with --num-speculative-tokens 2 and --prefix-caching too)",
    )
    p.add_argument(
        "--record-autotune",
        type=Path,
        default=None,
        metavar="DIR",
        help="after the warm-up, write fla's autotuning winners for this GPU there (kernels.autotune_seeds; "
        "run with a cold Triton cache and no seed file for the GPU, then commit it under src/fp4moe/data)",
    )
    args = p.parse_args()

    from fp4moe.engine.front.config import AUTO_GPU_BATCHED_TOKENS, EngineConfig
    from fp4moe.engine.front.llm import LLM
    from fp4moe.engine.runner.cuda_runner import CudaModelRunner
    from fp4moe.models.full_size import resolve

    calls: list[tuple[str, float]] = []

    def timed(name_of, fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                calls.append((name_of(*a, **kw), time.perf_counter() - t0))

        return wrapper

    def gen_name(self, prompts, params=None, *_, **__):
        lens = [len(x) for x in prompts]
        kind = "greedy" if params is None or params.temperature == 0 else "sampled"
        path = "graphs" if self.runner.use_prompt_graphs else "modules"
        return f"generate {path} {kind} {len(lens)} x {max(lens)}"

    LLM.generate = timed(gen_name, LLM.generate)
    CudaModelRunner._capture = timed(lambda self, b: f"decode graph {b}", CudaModelRunner._capture)
    CudaModelRunner._capture_prompt = timed(
        lambda self, b, t, continuing=False: f"{'chunk' if continuing else 'prompt'} graph {b} x {t}",
        CudaModelRunner._capture_prompt,
    )

    t0 = time.perf_counter()
    config = EngineConfig(
        device="cuda",
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        kv_cache_dtype=args.kv_cache_dtype,
        num_speculative_tokens=args.num_speculative_tokens,
        max_num_batched_tokens=AUTO_GPU_BATCHED_TOKENS,
        load_format="dummy",
    )
    llm = LLM(resolve(args.model, "dummy"), config)
    load = time.perf_counter() - t0
    warm = llm.warmup.run(config.max_num_batched_tokens, prefix_caching=args.prefix_caching)
    phases = {k: round(v, 2) for k, v in llm.warmup.phases.items()}
    print(f"load {load:.1f} s, warm-up {warm:.1f} s: {phases}")
    graphs = len(llm.runner.prompt_graphs) + len(llm.runner.chunk_graphs)
    direct = llm.runner.direct_captures
    print(f"prefill graphs: {graphs}, {direct} captured without an eager run first")
    nested = [c for c in calls if not c[0].startswith("generate")]  # captures inside generate calls too
    print(f"{len(calls)} timed calls ({len(nested)} captures); slowest:")
    for name, sec in sorted(calls, key=lambda c: -c[1])[: args.top]:
        print(f"  {sec:7.2f} s  {name}")
    job = llm.precompile
    if job is not None and job.total:
        print(
            f"precompiled {job.compiled} of {job.total} recorded Triton variants in {job.seconds:.1f} s "
            "(beside the load, which waited for them)"
        )
    if args.record_compiles:
        import torch

        from fp4moe.kernels import compile_seeds, compiles

        device = torch.device("cuda")
        gpu, target = torch.cuda.get_device_name(), compile_seeds.cuda_target(device)
        before = len(compile_seeds.load(gpu, target, args.record_compiles))
        config = compile_seeds.config_of(args.num_speculative_tokens)  # (an int here: never None)
        data = compile_seeds.record(
            gpu, compiles.specializations(), target, keep=args.record_compiles, config=config
        )
        path = compile_seeds.write(data, args.record_compiles)
        print(
            f"recorded {len(data['kernels'])} Triton variants ({len(data['kernels']) - before} new; this "
            f"configuration, {config}: {sum(config in k['configs'] for k in data['kernels'])}) to {path}"
        )
    if args.record_autotune:
        import torch

        from fp4moe.kernels import autotune_seeds

        data = autotune_seeds.record(torch.cuda.get_device_name())
        path = autotune_seeds.write(data, args.record_autotune)
        print(f"recorded {sum(map(len, data['kernels'].values()))} autotuning results to {path}")
    if args.out:
        result = dict(
            load_s=load,
            warmup_s=warm,
            phases=phases,
            prefill_graphs=graphs,
            direct_captures=direct,
            calls=calls,
        )
        write_result(args.out / "startup.json", result, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
