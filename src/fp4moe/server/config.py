"""The server's settings and limits (``fp4moe serve``'s options)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

PROMPT_CHARS_PER_TOKEN = 8  # default --max-prompt-chars = this x max_model_len (English averages ~4)


@dataclass
class ServerConfig:
    served_model_name: str
    api_key: str | None = None
    reasoning_parser: str | None = None  # "qwen3"
    tool_call_parser: str | None = None  # "qwen3_coder"
    enable_auto_tool_choice: bool = False
    max_image_bytes: int = 20 << 20
    allowed_media_domains: frozenset[str] = frozenset()  # hosts remote image URLs may come from
    max_n_sequences: int = 16384  # `n` at most (vLLM's VLLM_MAX_N_SEQUENCES default)
    max_prompt_chars: int | None = None  # None: PROMPT_CHARS_PER_TOKEN x max_model_len
    max_request_bytes: int | None = None  # None: room for max_prompt_chars of text and the images allowed
    # decoded image pixels: a request's images together (a 400 past it; two of the 32 Mi-pixel largest), and
    # the images being decoded at once across the server (~4 bytes a pixel: ~256 MB; more wait)
    max_image_pixels_per_request: int = 64 << 20
    max_image_pixels_in_flight: int = 64 << 20
    # threads decoding images: a quarter of the cores, 1 to 4 (on 2 cores more starve a CPU engine's steps)
    image_decode_workers: int = field(default_factory=lambda: max(1, min(4, (os.cpu_count() or 2) // 4)))

    def prompt_chars(self, max_model_len: int) -> int:
        if self.max_prompt_chars is not None:
            return self.max_prompt_chars
        return PROMPT_CHARS_PER_TOKEN * max_model_len

    def request_bytes(self, max_model_len: int, limit_images: int) -> int:
        """Up to 4 bytes a character of text (UTF-8), each allowed image as base64, and 1 MiB for the rest."""
        if self.max_request_bytes is not None:
            return self.max_request_bytes
        return (
            4 * self.prompt_chars(max_model_len) + limit_images * (self.max_image_bytes * 4 // 3) + (1 << 20)
        )
