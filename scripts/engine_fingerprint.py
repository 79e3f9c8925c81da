"""A fingerprint of the CPU engine's outputs: one hash of every token id and logprob it produces on the tests'
tiny random checkpoints (bf16 and NVFP4), fixed seeds, through the module path (greedy, sampled, speculating
with the MTP head) and through the fused GPU runner under Triton's interpreter (greedy and sampled). A change
that only moves code must leave the hash as it was (issue 62: run it before and after, compare).

    PYTHONPATH=src python scripts/engine_fingerprint.py [--checkpoints DIR]

``--checkpoints``: where the tiny checkpoints are written (kept, and reused when present: two trees compared
read the same weights); default a temporary directory. Takes a few minutes on two CPU cores.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # the fused runner's kernels on the CPU

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from fixtures import Checkpoints  # noqa: E402

try:  # the engine's layout after issue 62 ...
    from fp4moe.engine.front.llm import LLM
    from fp4moe.engine.request.sampler import SamplingParams
    from fp4moe.engine.runner.cuda_runner import CudaModelRunner
except ImportError:  # ... and before it (main 30c1e61), to compare the two
    from fp4moe.engine.cuda_runner import CudaModelRunner
    from fp4moe.engine.llm import LLM
    from fp4moe.engine.sampler import SamplingParams

PROMPTS = [[5, 17, 300, 2, 9], list(range(40, 110)), [7], [11, 12, 13, 14]]


def _fused(llm) -> None:
    """The GPU runner on the CPU, as tests/engine/runner_cases.py sets it up (no graphs, prompts through the
    modules)."""
    llm.runner = CudaModelRunner(
        llm.model, None, llm.device, "auto", num_pages=20, page_size=16, cuda_graphs=False,
        max_num_seqs=4, max_model_len=256,
    )  # fmt: skip
    llm.runner.fused_prefill = False


def _digest(h, name: str, outputs) -> None:
    for r in outputs:
        for c in r.outputs:
            h.update(f"{name}|{c.index}|{c.token_ids}|{c.finish_reason}|".encode())
            for lp in c.logprobs or []:
                h.update(repr((lp.token_id, lp.logprob, sorted((lp.top_logprobs or {}).items()))).encode())
    sub = hashlib.sha256(repr([[c.token_ids for c in r.outputs] for r in outputs]).encode()).hexdigest()[:12]
    print(f"{name:32s} tokens {sub}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoints", type=Path, default=None, help="where the tiny checkpoints are kept")
    args = ap.parse_args()
    root = args.checkpoints or Path(tempfile.mkdtemp(prefix="fp4moe-fingerprint-"))
    root.mkdir(parents=True, exist_ok=True)
    done = root / "written"
    if not done.exists():  # bf16-..., then its NVFP4 copy (RTN scales): Checkpoints names them in this order
        ck = Checkpoints(root)
        ck.quantized(scale_method="rtn")
        done.write_text("")
    bf16 = next(root.glob("bf16-*"))
    nvfp4 = next(root.glob("q-*"))
    torch.manual_seed(0)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    sampled = SamplingParams(
        max_tokens=8, temperature=0.8, top_p=0.9, ignore_eos=True, seed=1234, logprobs=1, n=2
    )
    h = hashlib.sha256()
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    for name, path in (("bf16", bf16), ("nvfp4", nvfp4)):
        llm = LLM(path, dtype="bfloat16", device="cpu")
        _digest(h, f"{name} module greedy", llm.generate(prompts, greedy))
        _digest(h, f"{name} module sampled", llm.generate(prompts, sampled))
        spec = LLM(path, dtype="bfloat16", device="cpu", num_speculative_tokens=2)
        _digest(h, f"{name} module spec greedy", spec.generate(prompts, greedy))
        _digest(h, f"{name} module spec sampled", spec.generate(prompts, sampled))
        _fused(llm)
        _digest(h, f"{name} fused greedy", llm.generate(prompts, greedy))
        _digest(h, f"{name} fused sampled", llm.generate(prompts, sampled))
    print(f"fingerprint {h.hexdigest()}")


if __name__ == "__main__":
    main()
