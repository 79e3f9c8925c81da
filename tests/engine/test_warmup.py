"""``LLM.warmup`` on the CPU path (no graphs to capture): its progress bar counts every step ahead and ends
full, and its phases add up to the time it returns. The GPU test (``test_cuda_runner``) checks the same
count with the graph captures."""

import pytest

from fp4moe.engine.front.llm import LLM


def test_warmup_shows_its_progress_and_counts_every_step(checkpoints, capsys):
    llm = LLM(checkpoints.bf16(), dtype="float32", max_model_len=256)
    took = llm.warmup.run(32)
    done, total = llm.warmup.steps
    # lengths 1-32 around powers of two (13), two chunked prompts past the step, two multi-prompt steps,
    # the same 14 again through the (absent) prefill graphs, greedy and sampled at one batch size
    assert done == total == 13 + 2 + 2 + 13 + 2
    err = capsys.readouterr().err
    assert "warm-up: prefill graphs" in err and f"{total}/{total}" in err
    assert sum(llm.warmup.phases.values()) == pytest.approx(took)


def test_warmup_without_progress_prints_nothing(checkpoints, capsys):
    llm = LLM(checkpoints.bf16(), dtype="float32", max_model_len=256)
    llm.warmup.run(8, progress=False)
    assert "warm-up" not in capsys.readouterr().err
    assert llm.warmup.steps[0] == llm.warmup.steps[1]
