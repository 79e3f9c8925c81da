"""The CPU engine needs no Triton (a torch-only install: macOS, CPU wheels): a whole generation with every
``triton`` import failing, in a fresh process, gives the tokens it gives with Triton installed."""

from __future__ import annotations

import json
import subprocess
import sys

GENERATE = r"""
import json, sys
if sys.argv[2] == "hidden":
    sys.modules["triton"] = None  # every import of triton (and triton.language) raises ImportError
from fp4moe.engine.front.llm import LLM
from fp4moe.engine.request.sampler import SamplingParams

llm = LLM(sys.argv[1], dtype="float32", device="cpu", max_model_len=128)
out = llm.generate([[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
print(json.dumps([o.outputs[0].token_ids for o in out]))
"""


def test_the_cpu_engine_generates_without_triton(checkpoints):
    path = str(checkpoints.bf16())
    tokens = {}
    for mode in ("hidden", "installed"):
        run = subprocess.run(
            [sys.executable, "-c", GENERATE, path, mode], capture_output=True, text=True, timeout=600
        )
        assert run.returncode == 0, run.stderr[-3000:]
        tokens[mode] = json.loads(run.stdout.strip().splitlines()[-1])
    assert tokens["hidden"] == tokens["installed"]
    assert [len(t) for t in tokens["hidden"]] == [6, 6]
