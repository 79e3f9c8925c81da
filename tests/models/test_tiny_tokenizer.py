"""The tiny/reference models' tokenizer encodes the same after a save and a reload: transformers loads a
qwen3_5_moe checkpoint's tokenizer as Qwen3_5Tokenizer, which imposes Qwen3.5's normalizer and pre-tokenizer
-- a tokenizer trained with another split would give the model token sequences it never saw in training."""

from __future__ import annotations

from transformers import AutoTokenizer

from fp4moe.data import corpus_text
from fp4moe.models.tiny import train_tokenizer


def test_a_saved_tokenizer_encodes_like_the_one_it_was_trained_as(checkpoints):
    path = checkpoints.bf16()  # written with train_tokenizer(); config.json says qwen3_5_moe
    reloaded = AutoTokenizer.from_pretrained(path)
    trained = train_tokenizer(1000)
    text = corpus_text("heldout")[:20000] + "a\n\nb  c\n\n\nd 12345 Ünïcödé\r\n"
    assert reloaded(text)["input_ids"] == trained(text)["input_ids"]
    assert "\n\n" in reloaded.decode(reloaded("x\n\ny")["input_ids"])
