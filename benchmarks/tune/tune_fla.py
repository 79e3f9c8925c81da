"""flash-linear-attention's autotuned prefill kernels tuned at prefill size, recorded as this GPU's seeds.

fla's autotuners key on head counts, head dims and dtypes, not on the token count: whichever call meets a key
first decides its config for every length after it. A server's warm-up meets them on short prompts, so the
recorded seeds (``kernels.autotune_seeds``) held configs picked at a few hundred tokens -- and an 8K prefill's
``chunk_gated_delta_rule_fwd_kkt_solve_kernel`` took 9.0 ms over 30 layers on the H200 where an earlier
profile had 2.8 (BENCHMARKS.md, "Where an 8K prefill's 182 ms of kernels go"). Here the full-size model
(random weights) runs, with no seeds and a cold Triton cache, one ``--tokens`` prompt first (the plain and
batched-fresh calls' keys), then one step of ``--sequences`` prompts of the same total (the varlen call's
keys); the winners are merged over the GPU's seed file (keys tuned here replace, others stay).

    TRITON_CACHE_DIR=$(mktemp -d) python3 benchmarks/tune/tune_fla.py --out src/fp4moe/data
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, provenance.py
from common import build_model  # noqa: E402

from fp4moe.kernels import autotune_seeds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--tokens", type=int, default=8192, help="tokens of the first prompt and of the varlen step"
    )
    ap.add_argument(
        "--sequences", type=int, default=4, help="prompts in the varlen step (tokens split evenly)"
    )
    ap.add_argument("--out", type=Path, default=autotune_seeds.SEED_DIR,
                    help="directory of the seed file to merge into and write (default: the package's)")  # fmt: skip
    args = ap.parse_args()
    autotune_seeds.seed = lambda *a, **k: 0  # no recorded winner: every key tunes on this script's calls
    from fp4moe.engine.reference.context import StepContext
    from fp4moe.engine.runner.cuda_runner import CudaModelRunner

    dev = torch.device("cuda")
    model = build_model(True, dev)
    n, seqs = args.tokens, args.sequences
    runner = CudaModelRunner(model, None, dev, "auto", max_num_seqs=seqs, max_model_len=n + 64,
                             num_pages=2 * (n // 64) + 8 * seqs, cuda_graphs=False)  # fmt: skip
    for lens in ([n], [n // seqs] * seqs):
        for slot in range(len(lens)):
            runner.kv.free(slot)
        ids = torch.randint(0, model.args.vocab_size, (sum(lens),), device=dev)
        pos = torch.cat([torch.arange(m, device=dev) for m in lens])
        ctx = StepContext(lens, [0] * len(lens), list(range(len(lens))), runner.kv, runner.states)
        start = time.perf_counter()
        runner.hidden_states(ids, pos, ctx)
        torch.cuda.synchronize()
        print(f"{lens}: tuned in {time.perf_counter() - start:.1f} s", flush=True)
    gpu = torch.cuda.get_device_name()
    new = autotune_seeds.record(gpu)
    for where, entries in new["kernels"].items():
        for e in entries:
            print(f"{where.split(':')[1]}: {e['config']['kwargs']} warps {e['config']['num_warps']} "
                  f"stages {e['config']['num_stages']}  key {e['key'][:6]}")  # fmt: skip
    old = autotune_seeds.read_seed(autotune_seeds.seed_path(gpu, args.out), "autotune")
    path = autotune_seeds.write(autotune_seeds.merge(old, new), args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
