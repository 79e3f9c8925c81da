"""A draft vocabulary for the MTP head (``--speculative-draft-vocab N``): the head drafts from N token ids, not
the whole vocabulary, as EAGLE-3's draft models do (a 32K draft vocabulary beside Llama 3's 128K) and FR-Spec's
frequency-ranked drafting, which SGLang takes as ``--speculative-token-map``.

Why: each draft of a round ends in the lm_head, and Qwen3.5/3.6's is 248,320 x 2,048 in bf16 -- 1 GB read per
draft, a quarter of a whole plain decode step at batch 1, twice per round at k = 2. With 32,768 ids a draft
reads 134 MB. Verification is unchanged, so outputs are too: greedy tokens are the target's own, and sampled
ones keep the target's distribution (a draft is drawn from, and tested against, the restricted distribution,
which is zero outside the N ids). What can change is acceptance: where the target's next token lies outside
the N ids, the draft cannot be it.

Which ids: the N lowest, and every special and added token (EOS, the chat and tool-call markers). Byte-level
BPE vocabularies (Qwen's, GPT's) number tokens in the order their merges were learned, most frequent pair
first, so the lowest ids are the tokenizer corpus's most frequent tokens and its 256 bytes; no text of ours is
needed to rank them. A tokenizer ordered otherwise (SentencePiece, or a multilingual extension appended at
the end) is ranked worse by this rule: keep the option off there, or measure acceptance with it on first."""

from __future__ import annotations

import torch


def draft_token_ids(vocab_size: int, n: int, tokenizer=None, extra_ids=()) -> torch.Tensor:
    """The draft vocabulary's ids, sorted: ``range(n)``, the tokenizer's special and added tokens and
    ``extra_ids`` (EOS ids), all below ``vocab_size``."""
    if n <= 0:
        raise ValueError(f"a draft vocabulary needs at least one token id, not {n}")
    ids = set(range(min(n, vocab_size))) | {int(i) for i in extra_ids}
    if tokenizer is not None:
        ids |= {int(i) for i in getattr(tokenizer, "all_special_ids", ())}
        ids |= {int(i) for i in getattr(tokenizer, "added_tokens_decoder", {})}
    return torch.tensor(sorted(i for i in ids if 0 <= i < vocab_size), dtype=torch.long)
