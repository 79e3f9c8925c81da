"""Host cost of detokenization per generated token (issue 20): the full decode of a sequence's output at
every token (what Sequence.append did) against the incremental window (Sequence._detokenize), at output
lengths 128 to 4,096, with the full-size model's synthetic 248,320-id tokenizer (Qwen3.5's pre-tokenizer)
on held-out text. Medians over the last 64 tokens of each length, in microseconds per token per sequence;
a step of a batch of B sequences pays B times that on the engine's thread.

    python benchmarks/detokenize.py
"""

from __future__ import annotations

import statistics
import time

from fp4moe.data import corpus_text
from fp4moe.engine.request.sampler import SampleResult, SamplingParams
from fp4moe.engine.request.sequence import Sequence
from fp4moe.models.full_size import synthetic_tokenizer


def per_token_us(tok, ids: list[int], incremental: bool) -> float:
    seq = Sequence(0, [0], SamplingParams(max_tokens=len(ids) + 1, ignore_eos=True), slot=0)
    times = []
    for t in ids:
        start = time.perf_counter()
        if incremental:
            seq.append(SampleResult(t), tok)
        else:
            seq.output_ids.append(t)
            seq.text = tok.decode(seq.output_ids, skip_special_tokens=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times[-64:]) * 1e6


def main() -> None:
    tok = synthetic_tokenizer()
    ids = tok(corpus_text("heldout"), add_special_tokens=False)["input_ids"]
    print("| output tokens | full decode per token (µs) | incremental (µs) | ratio |")
    print("|---|---|---|---|")
    for n in (128, 512, 1024, 4096):
        full, inc = per_token_us(tok, ids[:n], False), per_token_us(tok, ids[:n], True)
        print(f"| {n} | {full:.1f} | {inc:.1f} | {full / inc:.0f}× |")


if __name__ == "__main__":
    main()
