"""Incremental detokenization (Sequence._detokenize): after every token the text equals a full decode of
the output ids, the streamed deltas add up to it, and the work per token stays bounded."""

import torch

from fp4moe.engine.request.sampler import SampleResult, SamplingParams
from fp4moe.engine.request.sequence import MAX_WINDOW, Sequence
from fp4moe.models.tiny import train_tokenizer

TOK = train_tokenizer(1000)


class Counting:
    """The tokenizer, counting the ids it is asked to decode."""

    def __init__(self, tok):
        self.tok, self.decoded = tok, 0

    def decode(self, ids, **kw):
        self.decoded += len(ids)
        return self.tok.decode(ids, **kw)


def _stream(ids: list[int], tok=TOK, **params) -> tuple[Sequence, str]:
    seq = Sequence(0, [1, 2], SamplingParams(max_tokens=len(ids) + 1, ignore_eos=True, **params), slot=0)
    deltas = ""
    for i, t in enumerate(ids):
        deltas += seq.append(SampleResult(t), tok)
        if seq.finished:
            break
        if not params:
            assert seq.text == TOK.decode(ids[: i + 1], skip_special_tokens=True), i
    return seq, deltas


def test_text_is_the_full_decode_after_every_token_of_real_text():
    text = "naïve café — 日本語 and emoji 🙂🙂 in a sentence.\n<|im_end|> <think>x</think> " * 6
    ids = TOK(text, add_special_tokens=False)["input_ids"]
    seq, deltas = _stream(ids)
    assert seq.text == deltas + seq.text[len(deltas) :]  # deltas are a prefix (the rest is held back)
    assert TOK.decode(ids, skip_special_tokens=True).startswith(deltas)


def test_text_is_the_full_decode_for_random_ids_with_split_characters():
    """Random ids of the byte-level vocabulary: lone UTF-8 bytes that never complete a character, special
    and markup tokens -- the cases where a window must not be committed, or must fall back."""
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        ids = torch.randint(0, len(TOK), (300,), generator=g).tolist()
        _stream(ids)


def test_work_per_token_is_bounded():
    ids = TOK("The quick brown fox jumps over the lazy dog; café, naïve. " * 60, add_special_tokens=False)[
        "input_ids"
    ]
    counting = Counting(TOK)
    seq, _ = _stream(ids, tok=counting)
    assert seq.text == TOK.decode(ids, skip_special_tokens=True)
    assert counting.decoded < 4 * len(ids)  # a full decode per token would be len(ids)^2 / 2
    assert MAX_WINDOW >= 4  # a UTF-8 character spans at most 4 byte-tokens


def test_stop_strings_still_cut_the_text():
    ids = TOK("alpha beta STOP gamma delta", add_special_tokens=False)["input_ids"]
    seq, deltas = _stream(ids, stop=["STOP"])
    assert seq.finished and seq.text == "alpha beta " and deltas == "alpha beta "


def test_bytes_that_never_complete_fall_back_to_the_full_decode():
    """Lone UTF-8 continuation bytes keep the window open; past MAX_WINDOW tokens the whole text is
    decoded, and afterwards clean text commits again."""
    lone = next(i for i in range(len(TOK)) if TOK.decode([i]) == "\ufffd")
    clean = TOK("after the bytes, clean text again", add_special_tokens=False)["input_ids"]
    ids = [lone] * (3 * MAX_WINDOW) + clean
    counting = Counting(TOK)
    seq, _ = _stream(ids, tok=counting)
    assert seq.text.endswith("clean text again") and seq._read == len(ids)


def _sentencepiece_style():
    """A Llama-style decoder (Metaspace + byte fallback, the first token's leading space stripped): not
    concatenative, so a window needs a token of context."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "<0x80>": 2, "▁Hello": 3, "▁world": 4, "▁again": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", additional_special_tokens=["<s>"])


def test_a_decoder_that_strips_the_first_space_keeps_its_spaces():
    """After a skipped special token and after the whole-text fallback the next token still decodes with
    context (found by review: 'Helloworld' for [Hello, <s>, world], 'worldworld' after lone bytes)."""
    tok = _sentencepiece_style()
    for ids in ([3, 1, 4, 5], [3] + [2] * (MAX_WINDOW + 1) + [4, 4, 5], [3, 1, 1, 4, 1, 5]):
        seq = Sequence(0, [1], SamplingParams(max_tokens=len(ids) + 1, ignore_eos=True), slot=0)
        for i, t in enumerate(ids):
            seq.append(SampleResult(t), tok)
            assert seq.text == tok.decode(ids[: i + 1], skip_special_tokens=True), (ids, i, seq.text)
