"""Token windows cut from a tokenized text: at seeded random offsets for calibration (``random_windows``),
consecutive from the start for evaluation (``consecutive_windows``)."""

from __future__ import annotations

import torch

from fp4moe.errors import UserError


class WindowError(UserError, ValueError):
    """The text cannot give the windows asked for (too short, or a non-positive size)."""


def random_windows(ids: list[int], count: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    """``count`` windows of ``seq_len`` tokens [count, seq_len] at seeded random offsets: non-overlapping
    (distinct slots of the text's ``len // seq_len``) when the text is long enough, else overlapping."""
    if count <= 0 or seq_len <= 0:
        raise WindowError(f"num_samples and seq_len must be positive (got {count}, {seq_len})")
    t = torch.tensor(ids, dtype=torch.long)
    if t.numel() < seq_len:
        raise WindowError(f"the text has {t.numel()} tokens, fewer than --seq-len {seq_len}")
    gen = torch.Generator().manual_seed(seed)
    if count * seq_len <= t.numel():
        starts = torch.randperm(t.numel() // seq_len, generator=gen)[:count] * seq_len
    else:
        starts = torch.randint(0, t.numel() - seq_len + 1, (count,), generator=gen)
    return torch.stack([t[s : s + seq_len] for s in starts.tolist()])


def consecutive_windows(ids: list[int], seq_len: int, limit: int, min_len: int = 3) -> list[list[int]]:
    """Consecutive windows of ``seq_len`` tokens from the start, up to ``limit`` tokens in all; at least one
    window (shorter when the text is), of at least ``min_len`` tokens."""
    if seq_len < min_len:
        raise WindowError(f"--seq-len must be at least {min_len}, got {seq_len}")
    count = max(1, min(len(ids), limit) // seq_len)
    windows = [ids[i * seq_len : (i + 1) * seq_len] for i in range(count)]
    if len(windows[0]) < min_len:
        raise WindowError(f"the text has only {len(ids)} tokens")
    return windows
