"""Sampling: tests that fail when a mask, penalty, seed or stop rule is wrong."""

import pytest
import torch
from goodness_of_fit import ALPHA, assert_follows, needed_draws, p_value

from fp4moe.engine.front.llm import LLM
from fp4moe.engine.request.prompts import PromptError
from fp4moe.engine.request.sampler import (
    SampleRow,
    SamplingParams,
    _finite,
    _penalize,
    apply_penalties,
    filter_logits,
    sample,
    sample_batch,
    sample_tokens,
)


def _draws(logits, params, n=400, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [sample(logits, [], [], params, gen).token_id for _ in range(n)]


def test_greedy_is_argmax_and_ignores_seed():
    logits = torch.tensor([0.1, 2.0, 1.9, -1.0])
    assert _draws(logits, SamplingParams(temperature=0), n=5) == [1] * 5


def test_top_k_only_draws_the_k_best():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(1))
    best = set(torch.topk(logits, 3).indices.tolist())
    draws = set(_draws(logits, SamplingParams(temperature=2.0, top_k=3)))
    assert draws <= best and len(draws) == 3


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = torch.isfinite(filter_logits(logits.clone(), SamplingParams(top_p=0.8)))
    assert kept.tolist() == [True, True, False, False]  # 0.5 + 0.3 reaches 0.8
    kept = torch.isfinite(filter_logits(logits.clone(), SamplingParams(top_p=0.81)))
    assert kept.tolist() == [True, True, True, False]
    assert set(_draws(logits, SamplingParams(top_p=0.8))) == {0, 1}


def test_min_p_drops_tokens_below_a_fraction_of_the_top():
    logits = torch.log(torch.tensor([0.6, 0.3, 0.07, 0.03]))
    kept = torch.isfinite(filter_logits(logits.clone(), SamplingParams(min_p=0.1)))
    assert kept.tolist() == [True, True, True, False]  # 0.03 < 0.1 * 0.6


def test_temperature_sharpens_and_flattens():
    logits = torch.tensor([1.0, 0.0])
    cold = sum(t == 0 for t in _draws(logits, SamplingParams(temperature=0.2)))
    hot = sum(t == 0 for t in _draws(logits, SamplingParams(temperature=5.0)))
    assert cold > 380 and 180 < hot < 280  # p(0) = 0.993 vs 0.55


def test_seeded_draws_reproduce_and_differ_by_seed():
    logits = torch.zeros(100)
    p = SamplingParams(temperature=1.0)
    assert _draws(logits, p, 20, seed=7) == _draws(logits, p, 20, seed=7)
    assert _draws(logits, p, 20, seed=7) != _draws(logits, p, 20, seed=8)


def test_penalties_change_only_what_they_should():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    rep = apply_penalties(
        logits.clone(), prompt_ids=[0], output_ids=[1], p=SamplingParams(repetition_penalty=2.0)
    )
    assert rep.tolist() == [1.0, -4.0, 1.0, 0.5]  # positive divided, negative multiplied, unseen untouched
    pres = apply_penalties(
        logits.clone(), prompt_ids=[2], output_ids=[0, 0, 3], p=SamplingParams(presence_penalty=0.5)
    )
    assert pres.tolist() == [1.5, -2.0, 1.0, 0.0]  # output tokens only, once each
    freq = apply_penalties(
        logits.clone(), prompt_ids=[2], output_ids=[0, 0, 3], p=SamplingParams(frequency_penalty=0.5)
    )
    assert freq.tolist() == [1.0, -2.0, 1.0, 0.0]  # per occurrence


def test_logprobs_are_raw_model_logprobs():
    logits = torch.tensor([3.0, 1.0, 0.0, -1.0])
    r = sample(logits, [], [], SamplingParams(temperature=0, logprobs=2), None)
    lp = logits.log_softmax(-1)
    assert r.token_id == 0 and r.logprob == pytest.approx(float(lp[0]))
    assert r.top_logprobs == pytest.approx({0: float(lp[0]), 1: float(lp[1])})


@pytest.mark.parametrize(
    "bad",
    [
        dict(temperature=-1),
        dict(top_p=0),
        dict(top_p=1.5),
        dict(min_p=2),
        dict(max_tokens=0),
        dict(top_k=-2),
        dict(repetition_penalty=0),
        dict(presence_penalty=3),
        dict(n=0),
    ],
)
def test_invalid_params_are_rejected(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)


@pytest.fixture(scope="module")
def llm(checkpoints):
    return LLM(checkpoints.bf16(), dtype="float32")


def test_seeded_generation_is_reproducible(llm):
    p = SamplingParams(max_tokens=12, temperature=1.0, seed=42, ignore_eos=True)
    a = llm.generate("The quick brown", p)[0].outputs[0].token_ids
    assert a == llm.generate("The quick brown", p)[0].outputs[0].token_ids
    b = llm.generate(
        "The quick brown", SamplingParams(max_tokens=12, temperature=1.0, seed=43, ignore_eos=True)
    )
    assert a != b[0].outputs[0].token_ids


def test_stop_strings_cut_the_text(llm):
    greedy = llm.generate("def main():", SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[
        0
    ].outputs[0]
    text = greedy.text
    # a stop string that straddles the boundary between the 3rd and 4th generated tokens
    boundary = len(llm.tokenizer.decode(greedy.token_ids[:3], skip_special_tokens=True))
    stop = text[boundary - 2 : boundary + 2]
    assert len(stop) == 4
    first = text.find(stop)
    out = llm.generate(
        "def main():", SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop])
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.text == text[:first]
    streamed = llm.stream(
        "def main():", SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop])
    )
    assert "".join(streamed) == text[:first]
    out = llm.generate(
        "def main():",
        SamplingParams(
            max_tokens=24, temperature=0, ignore_eos=True, stop=[stop], include_stop_str_in_output=True
        ),
    )[0].outputs[0]
    assert out.text == text[: first + len(stop)]


def test_stop_token_ids_and_length(llm):
    greedy = llm.generate("Hello", SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0].outputs[
        0
    ]
    assert greedy.finish_reason == "length" and len(greedy.token_ids) == 10
    target = greedy.token_ids[4]
    out = llm.generate(
        "Hello", SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, stop_token_ids=[target])
    )[0]
    ids = out.outputs[0].token_ids
    assert (
        out.outputs[0].finish_reason == "stop"
        and ids == greedy.token_ids[: greedy.token_ids.index(target) + 1]
    )


def test_batch_of_mixed_prompts_matches_one_by_one(llm):
    prompts = ["a", "The Python tutorial explains " * 6, [5, 6, 7, 8]]
    p = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, p)]
    alone = [llm.generate(x, p)[0].outputs[0].token_ids for x in prompts]
    assert together == alone


def test_streaming_yields_the_same_text(llm):
    p = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    assert "".join(llm.stream("Hello world", p)) == llm.generate("Hello world", p)[0].outputs[0].text
    seen = []
    llm.generate(["x", "y"], p, on_token=lambda i, tok, delta: seen.append(i))
    assert seen.count(0) == 10 and seen.count(1) == 10


def test_chat_uses_the_template(llm):
    out = llm.chat(
        [{"role": "user", "content": "hi"}], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    )[0]
    assert out.prompt.startswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_n_samples_per_prompt(llm):
    out = llm.generate("Hi", SamplingParams(max_tokens=6, temperature=1.0, seed=1, n=3, ignore_eos=True))[0]
    assert len(out.outputs) == 3 and len({tuple(o.token_ids) for o in out.outputs}) > 1


def test_bad_prompts(llm):
    with pytest.raises(PromptError, match="empty prompt"):
        llm.generate([[]])
    with pytest.raises(PromptError, match="out of range"):
        llm.generate([[5, 10**6]])
    with pytest.raises(PromptError, match="maximum model length"):
        llm.generate([[1] * (llm.max_model_len + 1)])


class ByteTokenizer:
    """Each token id stands for a fixed byte string; decoding joins them as UTF-8 (like byte-level BPE)."""

    def __init__(self, pieces: list[bytes]):
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens=True):
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


def _stream(pieces: list[bytes], params: SamplingParams) -> tuple[list[str], str]:
    from fp4moe.engine.request.sampler import SampleResult
    from fp4moe.engine.request.sequence import Sequence

    tok = ByteTokenizer(pieces)
    seq = Sequence(0, [0], params, slot=0)
    deltas = []
    for i in range(len(pieces)):
        deltas.append(seq.append(SampleResult(i), tok))
        if seq.finished:
            break
    return deltas, seq.text


def test_streaming_never_emits_half_characters():
    text = "héllo 日本語!"
    raw = text.encode()
    pieces = [raw[i : i + 1] for i in range(len(raw))]  # one byte per token: characters split across tokens
    deltas, final = _stream(pieces, SamplingParams(max_tokens=len(pieces)))
    assert "".join(deltas) == final == text
    assert all("\ufffd" not in d for d in deltas)


def test_stop_string_split_across_tokens_is_never_streamed():
    pieces = [b"hello", b" w", b"or", b"ld", b" f", b"oo"]
    deltas, final = _stream(pieces, SamplingParams(max_tokens=10, stop=["world f"]))
    assert final == "hello " and "".join(deltas) == "hello "
    deltas, final = _stream(
        pieces, SamplingParams(max_tokens=10, stop=["world f"], include_stop_str_in_output=True)
    )
    assert final == "hello world f" and "".join(deltas) == final
    deltas, final = _stream(pieces, SamplingParams(max_tokens=6, stop=["zzz"]))
    assert "".join(deltas) == final == "hello world foo"  # held-back text is released at the end


def test_min_p_comes_before_top_k_and_top_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.1, 0.1]))
    kept = torch.isfinite(filter_logits(logits.clone(), SamplingParams(top_p=0.6, min_p=0.25)))
    # min-p (0.25 * 0.5 = 0.125) drops 2 and 3; renormalised, 0.5/0.8 = 0.625 >= top_p keeps only token 0
    assert kept.tolist() == [True, False, False, False]


def test_logprobs_are_raw_even_with_temperature_and_penalties():
    logits = torch.tensor([3.0, 1.0, 0.5, -1.0])
    p = SamplingParams(temperature=0.5, repetition_penalty=2.0, presence_penalty=1.0, logprobs=1, seed=0)
    r = sample(logits, [0], [0, 1], p, torch.Generator().manual_seed(0))
    raw = logits.log_softmax(-1)
    assert r.logprob == pytest.approx(float(raw[r.token_id]))
    assert r.top_logprobs == pytest.approx({0: float(raw[0])})


def test_stop_params_are_validated_and_normalised():
    with pytest.raises(ValueError, match="non-empty strings"):
        SamplingParams(stop=[""])
    assert SamplingParams(stop=None, stop_token_ids=None).stop_token_ids == []


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1e-308),  # below vLLM's epsilon: greedy, not logits / 1e-308
        SamplingParams(temperature=0.7, repetition_penalty=1e-308),  # seen positive logits overflow to inf
        SamplingParams(temperature=1e300),
        SamplingParams(temperature=0.5, top_p=0.5, repetition_penalty=1e-308),
    ],
    ids=["tiny-temperature", "tiny-repetition-penalty", "huge-temperature", "top-p-overflow"],
)
@pytest.mark.parametrize("batched", [False, True])
def test_extreme_values_never_fail_a_draw(params, batched):
    """They raised 'probability tensor contains inf/nan' inside the engine step, failing every request of
    the batch (and, batched, 'value cannot be converted to type float without overflow'); now each gives a
    token of the vocabulary."""
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0)) * 5
    if batched:  # beside a plain row, which must not be touched
        rows = [
            SampleRow(params, [1, 2, 3], [4], torch.Generator().manual_seed(1)),
            SampleRow(SamplingParams(temperature=0), [], []),
        ]
        result, plain = sample_batch(torch.stack([logits, logits]), rows)
        assert plain.token_id == int(logits.argmax())
    else:
        result = sample(logits, [1, 2, 3], [4], params, torch.Generator().manual_seed(1))
    assert 0 <= result.token_id < 50
    if params.repetition_penalty < 1e-300 and params.top_p == 1.0:
        assert result.token_id in {1, 2, 3, 4} or logits[[1, 2, 3, 4]].max() <= 0  # the seen ones dominate
    assert SamplingParams(temperature=1e-6).greedy and not SamplingParams(temperature=1e-5).greedy


# the batched sampler (sample_batch) against the per-sequence reference (sample)

BATCH_PARAMS = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0, repetition_penalty=1.3, logprobs=3),
    SamplingParams(temperature=0, presence_penalty=0.7, frequency_penalty=0.4),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=4),
    SamplingParams(temperature=1.3, top_p=0.7),
    SamplingParams(temperature=0.9, min_p=0.08),
    SamplingParams(temperature=0.8, top_k=6, top_p=0.9, min_p=0.02, repetition_penalty=1.2, logprobs=2),
    SamplingParams(temperature=1.0, frequency_penalty=0.5, presence_penalty=-0.3),
]


def _history(i: int) -> tuple[list[int], list[int]]:
    g = torch.Generator().manual_seed(100 + i)
    return torch.randint(0, 24, (5,), generator=g).tolist(), torch.randint(0, 24, (7,), generator=g).tolist()


def _reference_probs(logits: torch.Tensor, row: SampleRow) -> torch.Tensor:
    """What ``sample`` draws from (its own steps, spelled out)."""
    x = _finite(apply_penalties(logits.float().clone(), row.prompt_ids, row.output_ids, row.params))
    return _finite(filter_logits(x, row.params)).softmax(-1)


def test_batched_greedy_rows_and_logprobs_are_exact_against_the_reference():
    logits = torch.randn(len(BATCH_PARAMS), 24, generator=torch.Generator().manual_seed(3)) * 3
    rows = [SampleRow(p, *_history(i)) for i, p in enumerate(BATCH_PARAMS)]
    penalized = [i for i, r in enumerate(rows) if r.params.penalized]
    batched = _penalize(logits.clone(), rows, penalized)
    for i in penalized:  # the same fp32 operations: bitwise equal
        ref = apply_penalties(logits[i].clone(), rows[i].prompt_ids, rows[i].output_ids, rows[i].params)
        assert torch.equal(batched[i], ref), i
    torch.manual_seed(0)
    got = sample_batch(logits, rows)
    for i, (row, result) in enumerate(zip(rows, got, strict=True)):
        if row.params.greedy:
            want = sample(logits[i], row.prompt_ids, row.output_ids, row.params, None)
            assert result == want, i
        if row.params.logprobs is not None:
            raw = logits[i].log_softmax(-1)
            assert result.logprob == pytest.approx(float(raw[result.token_id]), abs=1e-6)
            top = torch.topk(raw, row.params.logprobs)
            assert list(result.top_logprobs) == top.indices.tolist()
        else:
            assert result.logprob is None and result.top_logprobs is None


def test_batched_draws_follow_the_reference_distribution():
    """Every sampled parameter set (plain temperature, top-k, top-p, min-p, penalties), each on as many rows
    as a chi-square test needs to catch a 0.02 total-variation bias with probability 0.99
    (tests/engine/goodness_of_fit.py: 31-55 thousand here), all in one batch (so rows with and without each
    filter sit side by side): each set's draws follow the distribution ``sample`` draws from, exactly
    computed, and tokens the filters drop are never drawn."""
    vocab = 24
    base = torch.randn(vocab, generator=torch.Generator().manual_seed(5)) * 2
    # (and a min-p large enough to drop tokens above min_p x the top probability but below min_p)
    params = [p for p in BATCH_PARAMS if not p.greedy] + [SamplingParams(temperature=1.0, min_p=0.3)]
    sampled = [SampleRow(p, *_history(j)) for j, p in enumerate(params)]
    targets = [_reference_probs(base, row) for row in sampled]
    counts = [needed_draws(t) for t in targets]
    rows = [row for row, n in zip(sampled, counts, strict=True) for _ in range(n)]
    torch.manual_seed(1)
    tokens = sample_tokens(base.expand(len(rows), vocab), rows).split(counts)
    for row, target, drawn in zip(sampled, targets, tokens, strict=True):
        assert_follows(drawn, target, row.params)


def test_batched_draws_match_the_per_sequence_sampler():
    """The two samplers' empirical distributions of one parameter set agree (two-sample, 5 standard errors;
    ``sample`` is torch.multinomial after the filters, which the filter tests above and the exact greedy rows check)."""
    n, vocab = 4000, 24
    base = torch.randn(vocab, generator=torch.Generator().manual_seed(6)) * 2
    p = SamplingParams(temperature=0.8, top_k=8, top_p=0.95, repetition_penalty=1.1)
    prompt, output = _history(0)
    torch.manual_seed(2)
    batched = [r.token_id for r in sample_batch(base.expand(n, vocab), [SampleRow(p, prompt, output)] * n)]
    gen = torch.Generator().manual_seed(2)
    single = [sample(base, prompt, output, p, gen).token_id for _ in range(n)]
    a = torch.bincount(torch.tensor(batched), minlength=vocab).double() / n
    b = torch.bincount(torch.tensor(single), minlength=vocab).double() / n
    pooled = (a + b) / 2
    assert ((a - b).abs() <= 5 * (2 * pooled * (1 - pooled) / n).sqrt() + 1e-9).all(), (a, b)


def test_seeded_draws_follow_the_reference_distribution():
    """Seeded rows (each its own seed, as requests are) draw each token with the probability ``sample``
    gives it: chi-square at the power stated in goodness_of_fit.py; filtered tokens never drawn."""
    vocab = 24
    base = torch.randn(vocab, generator=torch.Generator().manual_seed(8)) * 2
    p = SamplingParams(temperature=0.7, top_k=10, top_p=0.9, seed=0)
    target = _reference_probs(base, SampleRow(p, [], []))
    n = needed_draws(target)
    rows = [SampleRow(p, [], [], torch.Generator().manual_seed(1000 + j)) for j in range(n)]
    assert_follows(sample_tokens(base.expand(n, vocab), rows), target, p)


def test_a_sampler_002_off_fails_the_check():
    """The check's power, seen: draws from a distribution 0.02 (total variation) from the target -- the bias
    proportional to the target, the hardest to see -- fail it at the sample size it asks for."""
    target = (torch.randn(24, generator=torch.Generator().manual_seed(5)) * 2).softmax(-1).double()
    sign = torch.where(torch.arange(24) % 2 == 0, 1.0, -1.0).double()
    shift = target * (sign - (target * sign).sum())  # sums to 0
    off = target + 0.02 * shift / (0.5 * shift.abs().sum())
    assert abs(0.5 * float((off - target).abs().sum()) - 0.02) < 1e-9 and (off >= 0).all()
    n = needed_draws(target)
    biased = torch.multinomial(off, n, replacement=True, generator=torch.Generator().manual_seed(0))
    assert p_value(biased, target) < ALPHA
    fair = torch.multinomial(target, n, replacement=True, generator=torch.Generator().manual_seed(0))
    assert p_value(fair, target) >= ALPHA


def test_seeded_rows_depend_on_their_seed_alone():
    """A seeded row draws the same tokens alone or in any batch (its noise comes from its own generator)."""
    vocab, steps = 50, 6
    logits = torch.randn(steps, 4, vocab, generator=torch.Generator().manual_seed(9))
    p = SamplingParams(temperature=1.0, top_p=0.95, seed=17)

    def run(batch_of: int, seed: int, position: int) -> list[int]:
        gen, out = torch.Generator().manual_seed(seed), []
        for t in range(steps):
            rows = [SampleRow(SamplingParams(temperature=1.0), [], []) for _ in range(batch_of)]
            rows[position] = SampleRow(p, [], [], gen)
            out.append(sample_batch(logits[t, :batch_of], rows)[position].token_id)
        return out

    alone = run(1, 17, 0)
    logits[:, 3] = logits[:, 0]  # the seeded row's logits, wherever it sits
    assert run(4, 17, 3) == alone
    assert run(4, 18, 3) != alone
