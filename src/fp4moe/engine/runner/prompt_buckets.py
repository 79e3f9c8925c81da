"""The prefill graphs' shapes: which graph -- (sequences, rows each) -- takes a step's prompts, and how the
step's prompts split into graphs. Arithmetic over lengths only; the runner captures and replays a graph per
shape (``engine.runner.cuda_runner``)."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable

# prompt lengths with a captured prefill graph (a fresh prompt pads up to the next one): one eager 512-token
# prefill enqueued for 177 ms on the H200 against 28 ms of kernels (benchmarks/prefill_batch.py): a served
# single stream's time to first token was that host work. From 256 rows on, each length is at most 25% above
# the one before, so a prompt pads by less than a quarter (it was up to a half: 64 prompts of ~520 tokens ran in
# 768-row slots, two-thirds of each prefill graph's rows real). Past 2,048 every 512 rows, up to a step's 8,192:
# the module path's host time is ~150 ms a step whatever its rows (benchmarks/chunk_profile.py), more than
# the kernels of a prompt below ~6K tokens take, and these lengths are the ones cuDNN's attention runs at
PROMPT_GRAPH_TOKENS = (16, 32, 64, 96, 128, 192, 256, 320, 384, 448, 512, 576, 640, 768, 896, 1024, 1280, 1536,
                       1792, 2048, *range(2560, 8192 + 1, 512))  # fmt: skip
PROMPT_GRAPH_SEQS = (1, 2, 4, 8, 16, 32, 64, 128)  # prompts in one graph (each padded to the longest)
# a prefill graph replay's cost beyond its rows, in rows (H200, full size: 512 rows 31 ms, 4,608 rows 102 ms,
# 8,192 rows 164 ms -- about 20 ms and 17.5 us a row): ``partition`` weighs padding against replays
REPLAY_ROWS = 1024

Shape = tuple[int, int]  # (sequences, rows each)


def bucket(longest: int, count: int, max_seqs: int, max_rows: int) -> Shape | None:
    """The graph that takes ``count`` prompts, the longest ``longest`` tokens, where a graph holds at most
    ``max_seqs`` sequences and ``max_rows`` rows; None where none does. (``partition`` asks it for every
    group it weighs: bisection, not a scan.)"""
    i, j = bisect_left(PROMPT_GRAPH_TOKENS, longest), bisect_left(PROMPT_GRAPH_SEQS, count)
    if i == len(PROMPT_GRAPH_TOKENS) or j == len(PROMPT_GRAPH_SEQS):
        return None
    t, b = PROMPT_GRAPH_TOKENS[i], PROMPT_GRAPH_SEQS[j]
    return None if b > max_seqs or b * t > max_rows else (b, t)


def partition(lens: list[int], shape_of: Callable[[int, int], Shape | None]) -> list[tuple[list[int], Shape]]:
    """Prompts of ``lens`` tokens (longest first, each with a graph of its own: ``shape_of(longest, count)``)
    in consecutive groups that one graph each takes -> (indices into ``lens``, the graph) per group: the
    partition with the fewest rows, counting each replay as ``REPLAY_ROWS`` more (dynamic programming over
    where the groups end). Fifteen prompts of 466-530 tokens take one 16 x 576 graph (9,216 rows; they took
    two 8 x 576 ones and a 1 x 512: 232 ms on the H200, where one replay of 9,216 rows runs at about 20 ms +
    17.5 us a row); a 20-token prompt beside a 1,000-token one joins its graph (1,004 rows of padding
    against a replay of its own: about even); a 600-token one beside a 2,000-token one does not."""
    # best[k]: (cost, rows, first index of the last group) of the first k prompts. Some best partition has
    # every group but the last full (as many prompts as its graph's sequences): the next group's first prompt
    # moves into a group with room at no cost there (it is no longer) and none in its own group (one prompt
    # fewer, its longest no longer). So groups end at full sizes, or at the last prompt.
    n = len(lens)
    best: list[tuple[float, int, int]] = [(0.0, 0, 0)]
    for k in range(1, n + 1):
        options = []
        for size in range(1, k + 1) if k == n else (b for b in PROMPT_GRAPH_SEQS if b <= k):
            j = k - size  # the group is lens[j:k]; its longest prompt is lens[j]
            shape = shape_of(lens[j], size)
            if shape is None:
                break  # nor will a larger group (more prompts, none shorter) fit a graph
            rows = shape[0] * shape[1]
            options.append((best[j][0] + rows + REPLAY_ROWS, best[j][1] + rows, j))
        best.append(min(options))  # never empty: a prompt alone has a graph
    groups, k = [], n
    while k:
        j = best[k][2]
        groups.append((list(range(j, k)), shape_of(lens[j], k - j)))
        k = j
    return groups[::-1]
