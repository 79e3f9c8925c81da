"""Speculation's cost at the batch it runs in (``SpecCost``): rounds judged by tokens per millisecond against
plain steps at the same batch bucket. The arithmetic is exact (fp64 on given times), so the verdicts are."""

from __future__ import annotations

from fp4moe.engine.spec.spec_cost import PLAIN_EVERY, WINDOW, SpecCost, batch_bucket


def _rounds(cost: SpecCost, n: int, ms: float, tokens: float, count: int) -> list:
    verdicts = []
    for _ in range(count):
        cost.add("round", n, ms)
        verdicts.append(cost.verdict(n, tokens))
    return verdicts


def test_rounds_that_serve_fewer_tokens_per_ms_than_plain_steps_lose():
    cost = SpecCost(True)
    assert _rounds(cost, 16, 14.2, 2.4, WINDOW) == [None] * (WINDOW - 1) + ["plain"]  # no plain time yet
    cost.add("plain", 16, 6.6)
    # 2.4 tokens in 14.2 ms (0.169 a ms) against 1 in 6.6 (0.152): rounds pay
    assert _rounds(cost, 16, 14.2, 2.4, 2 * WINDOW) == [None] * 2 * WINDOW
    # 1.79 tokens a round, what the served run at 16 streams of 8K appended (0.126 a ms): they lose once the
    # window's mean falls below 14.2 / 6.6 = 2.15 tokens, the fourth such round
    verdicts = _rounds(cost, 16, 14.2, 1.79, WINDOW)
    assert verdicts[:4] == [None, None, None, "loses"]
    # the window starts afresh: a whole window of rounds before the next verdict
    assert verdicts[4:] == [None] * (WINDOW - 4) and len(cost.round_ms[16]) == WINDOW - 4
    assert _rounds(cost, 16, 14.2, 1.79, 4) == [None, None, None, "loses"]


def test_buckets_are_judged_apart_and_plain_times_refresh():
    cost = SpecCost(True)
    cost.add("plain", 1, 2.5)
    assert batch_bucket(3) == batch_bucket(4) == 4 and batch_bucket(1) == 1
    assert (
        _rounds(cost, 3, 4.3, 2.4, WINDOW)[-1] == "plain"
    )  # bucket 4 has no plain time: bucket 1's does not count
    cost.add("plain", 4, 3.0)
    # batch 1: a round of 4.3 ms carrying 2.4 tokens pays against 2.5 ms plain steps (0.558 > 0.4)
    assert set(_rounds(cost, 1, 4.3, 2.4, PLAIN_EVERY - 1)) == {None}
    assert _rounds(cost, 1, 4.3, 2.4, 1) == ["plain"]  # PLAIN_EVERY rounds on: time a plain step again
    cost.add("plain", 1, 3.5)
    assert cost.plain_ms[1] == 0.75 * 2.5 + 0.25 * 3.5  # a running estimate
    assert _rounds(cost, 1, 4.3, 2.4, 1) == [None]


def test_nothing_is_judged_on_the_cpu():
    cost = SpecCost(False)
    with cost.timed("round", 4):
        pass
    assert cost.verdict(4, 1.0) is None and not cost._pending


def test_timed_work_is_read_as_it_finishes(monkeypatch):
    """``timed`` reads what has finished each time (a server of plain steps alone asks for no verdict, and
    its events must not pile up); unfinished work waits, in order."""
    import fp4moe.engine.spec.spec_cost as sc

    class Event:  # a stand-in CUDA event: done once ``done`` says so
        done = set()

        def __init__(self, **_):
            self.id = len(made)
            made.append(self)

        def record(self):
            pass

        def query(self):
            return self.id in Event.done

        def elapsed_time(self, end):
            return float(end.id - self.id)

    made = []
    monkeypatch.setattr(sc.torch.cuda, "Event", Event)
    cost = SpecCost(True)
    for _ in range(3):
        with cost.timed("plain", 1):
            pass
    assert len(cost._pending) == 3 and cost.plain_ms == {}
    Event.done = {1, 5}  # the first and the third are done, the second not: the read stops at the second
    with cost.timed("plain", 1):
        pass
    assert len(cost._pending) == 3 and cost.plain_ms == {1: 1.0}
    Event.done = {1, 3, 5, 7, 9}
    with cost.timed("round", 2):
        pass
    assert not cost._pending and cost.plain_ms[1] == 1.0 and cost.round_ms[2] == [1.0]
