"""The qwen3 reasoning parser: text before ``</think>`` is ``reasoning_content``, text after it is ``content``.

Qwen3.5/3.6 chat templates open ``<think>\\n`` in the prompt, so the output usually holds only the closing
tag; a leading ``<think>`` in the output is dropped too. Without any ``</think>``, the output is reasoning
when the prompt opened a think block (it was cut short) and content otherwise. Streaming holds back text
that could be the start of a tag.
"""

from __future__ import annotations

from dataclasses import dataclass

OPEN, CLOSE = "<think>", "</think>"


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


def partial_tag_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningParser:
    def __init__(self, prompt_opened_think: bool = True):
        self.in_reasoning = prompt_opened_think
        self._pending = ""
        self._at_start = True
        self._after_close = False  # drop the newlines that follow </think>

    def feed(self, delta: str) -> ReasoningDelta:
        """Split a text delta; returns what can be emitted now."""
        text, self._pending = self._pending + delta, ""
        out = ReasoningDelta()
        if self._at_start:
            stripped = text.lstrip()
            if not stripped or (OPEN.startswith(stripped) and stripped != OPEN):
                self._pending = text  # could still become <think>
                return out
            if stripped.startswith(OPEN):
                text, self.in_reasoning = stripped[len(OPEN) :], True
            self._at_start = False
        if self.in_reasoning:
            i = text.find(CLOSE)
            if i < 0:
                keep = partial_tag_suffix(text, CLOSE)
                out.reasoning, self._pending = text[: len(text) - keep], text[len(text) - keep :]
                return out
            out.reasoning, text = text[:i], text[i + len(CLOSE) :]
            self.in_reasoning, self._after_close = False, True
        if self._after_close:
            text = text.lstrip("\n")
            self._after_close = not text
        out.content = text
        return out

    def finish(self) -> ReasoningDelta:
        """Whatever was held back, at the end of the output."""
        text, self._pending = self._pending, ""
        return ReasoningDelta(reasoning=text) if self.in_reasoning else ReasoningDelta(content=text)


def split_reasoning(text: str, prompt_opened_think: bool = True) -> tuple[str | None, str]:
    """(reasoning_content or None, content) of a whole output."""
    if CLOSE not in text and not text.lstrip().startswith(OPEN) and not prompt_opened_think:
        return None, text
    parser = ReasoningParser(prompt_opened_think)
    a, b = parser.feed(text), parser.finish()
    reasoning, content = a.reasoning + b.reasoning, a.content + b.content
    return (reasoning.strip("\n") or None), content
