"""``fp4moe bench``'s client (``bench/client.py``): the summary of a round -- speculative decoding counters
from vLLM's and our servers, the steady decode window -- on results built by hand (no server)."""

from __future__ import annotations


def test_bench_reads_vllm_spec_decode_counters():
    from fp4moe.bench.client import RequestResult, RoundResult, summarize

    ok = RequestResult(ok=True, prompt_tokens=10, completion_tokens=8, ttft=0.1, e2e=1.0, decode_tps=7.7)
    spec = {"drafts": 10.0, "draft_tokens": 20.0, "accepted": 15.0, "pos0": 9.0, "pos1": 6.0}
    row = summarize([RoundResult(16, 8, 0, 1, [ok], 1.0, spec)])[0]
    assert row["spec_acceptance_rate"] == 0.75 and row["spec_mean_acceptance_length"] == 2.5
    assert row["spec_acceptance_per_position"] == [0.9, 0.6]
    assert "spec_started_backed_off" not in row  # vLLM has no such counter
    ours = {**spec, "backoffs": 2.0, "started_backed_off": 3.0}
    row = summarize([RoundResult(16, 8, 0, 1, [ok], 1.0, ours)])[0]
    assert (row["spec_backoffs"], row["spec_started_backed_off"]) == (2, 3)


def test_steady_decode_counts_only_the_window_where_every_request_decodes():
    from fp4moe.bench.client import RequestResult, RoundResult, rounds_json, steady_decode, summarize

    # request a decodes one token per 0.1 s from t = 0 to 1.9 (20 chunks); b starts at 1.0 and sends two
    # tokens per chunk every 0.2 s up to 3.0: together from 1.0 to 1.9, where a gives 9 tokens and b 8
    a = RequestResult(ok=True, completion_tokens=20, ttft=0.1, chunk_times=[0.1 * i for i in range(20)])
    b = RequestResult(ok=True, completion_tokens=22, ttft=1.0, chunk_times=[1.0 + 0.2 * i for i in range(11)])
    rate, window = steady_decode([a, b])
    assert abs(window - 0.9) < 1e-9 and abs(rate - (9 + 2 * 4) / 0.9) < 1e-6
    late = RequestResult(ok=True, completion_tokens=3, ttft=2.0, chunk_times=[2.0, 2.1, 2.2])
    assert steady_decode([a, late]) is None  # a ended before the late one began: no window
    assert steady_decode([a, RequestResult(ok=False)]) is None  # a failed request: the round is not steady
    assert steady_decode([a])[0] == 19 / 1.9  # one stream: its own decode rate
    row = summarize([RoundResult(8, 20, 0, 2, [a, b], 3.0), RoundResult(8, 20, 0, 2, [a, late], 3.0)])[0]
    assert row["decode_steady_tps_median"] == rate and row["steady_window_s_median"] == window
    assert "chunk_times" not in rounds_json([RoundResult(8, 20, 0, 1, [a], 3.0)])[0]["requests"][0]


def test_each_round_keeps_its_own_medians():
    """``per_run``: one median per timed round beside the medians over every request (the runs' spread)."""
    from fp4moe.bench.client import RequestResult, RoundResult, summarize

    def req(tps, ttft):
        return RequestResult(ok=True, completion_tokens=9, ttft=ttft, e2e=1.0, decode_tps=tps)

    rounds = [RoundResult(8, 10, 0, 2, [req(a, t), req(b, t)], w) for a, b, t, w in
              [(10.0, 12.0, 0.1, 2.0), (20.0, 22.0, 0.3, 1.0), (30.0, 1.0, 0.2, 3.0)]]  # fmt: skip
    row = summarize(rounds)[0]
    assert row["per_run"]["decode_tps_per_request"] == [11.0, 21.0, 15.5]
    assert row["per_run"]["ttft_s"] == [0.1, 0.3, 0.2]
    assert row["per_run"]["aggregate_tps"] == [9.0, 18.0, 6.0]
    assert row["decode_tps_per_request_median"] == 16.0  # over all six requests
