"""The request side of a model: tokenizer, chat template, prompt checks, EOS ids, images into pixels.

``Prompts`` needs no weights. ``LLM`` holds one, and so does the API front of ``fp4moe serve`` when the
engine loop runs in its own process (``engine/front/process.py``): prompts are encoded in the front and only
token ids (and an image's pixels) cross to the engine. The vision tower's encoding stays with the engine.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from pathlib import Path

from fp4moe.engine.request.sampler import SamplingParams
from fp4moe.engine.request.sequence import Sequence
from fp4moe.errors import UserError


class PromptError(UserError, ValueError):
    pass


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    if not (path / "tokenizer_config.json").exists() and not (path / "tokenizer.json").exists():
        return None
    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)


class Prompts:
    def __init__(
        self,
        path: str | Path,
        config: dict,
        vocab_size: int,
        max_model_len: int,
        limit_images: int,
        load_format: str = "auto",
    ):
        self.path = Path(path)
        self.config = config
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.limit_images = limit_images
        self.load_format = load_format
        self.tokenizer = load_tokenizer(self.path)
        self.eos_ids = self._eos_ids()
        self._processor = None
        self._seq_ids = itertools.count()

    def _eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        gen = self.path / "generation_config.json"
        sources = [self.config.get("text_config", {}), self.config]
        if gen.exists():
            sources.append(json.loads(gen.read_text()))
        for src in sources:
            eos = src.get("eos_token_id")
            if eos is not None:
                ids.update(eos if isinstance(eos, list) else [eos])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(ids)

    def encode(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a prompt, checked: not empty, ids in the vocabulary, room to generate."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise PromptError(f"{self.path} has no tokenizer: pass token ids instead of text")
            ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
            text = prompt
        else:
            ids, text = [int(t) for t in prompt], None
        if not ids:
            raise PromptError("empty prompt")
        if max(ids) >= self.vocab_size or min(ids) < 0:
            raise PromptError(f"token id out of range [0, {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise PromptError(
                f"prompt has {len(ids)} tokens; the maximum model length is {self.max_model_len}"
            )
        return text, ids

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise PromptError(f"{self.path} has no chat template")
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )

    def _image_processor(self):
        from fp4moe.engine.request.multimodal import ImageError, ImageProcessor

        if "vision_config" not in self.config:
            raise ImageError(f"{self.path} has no vision tower (no vision_config): it cannot take images")
        if self.load_format == "dummy":
            raise ImageError("--load-format dummy builds the text model only: it cannot take images")
        if self._processor is None:
            self._processor = ImageProcessor(self.path)
        return self._processor

    def load_image_processor(self) -> int | None:
        """Load the image processor now (a server's start-up, not its first image request: a model folder
        it cannot read fails the start) -> the pixels an image is shrunk to (None: no images, or no limit)."""
        from fp4moe.engine.request.multimodal import ImageError

        try:
            return self._image_processor().max_pixels
        except ImageError:  # a text-only model: image requests get this error as a 400
            return None
        except (OSError, ValueError) as e:
            raise PromptError(f"cannot load the image processor of {self.path}: {str(e)[:300]}") from None

    def attach_images(self, seq: Sequence, images: list) -> None:
        """Expand the prompt's image placeholders, set its 3-D positions and the images' pixels
        (``seq.pixel_values``, ``seq.image_grid``), which the engine's vision tower encodes
        (``LLM.encode_images``)."""
        from fp4moe.engine.request.multimodal import ImageError, expand_image_tokens, mrope_positions

        if len(images) > self.limit_images:
            raise ImageError(
                f"{len(images)} images in one prompt; the limit is {self.limit_images} (--limit-mm-per-prompt)"
            )
        processed = self._image_processor()(images)
        merge = int(self.config["vision_config"].get("spatial_merge_size", 2))
        image_token = int(self.config["image_token_id"])
        ids = expand_image_tokens(seq.prompt_ids, image_token, processed.token_counts(merge))
        if len(ids) >= self.max_model_len:
            raise PromptError(
                f"prompt has {len(ids)} tokens with its images; the maximum model length is {self.max_model_len}"
            )
        seq.prompt_ids = ids
        seq.prompt_positions, seq.rope_delta = mrope_positions(ids, image_token, processed.grid_thw, merge)
        seq.pixel_values, seq.image_grid = processed.pixel_values, processed.grid_thw

    def make_sequences(
        self,
        prompts: list,
        params: list[SamplingParams],
        encode_images: Callable[[Sequence], None] | None = None,
    ) -> tuple[list[tuple[str | None, list[int]]], list[Sequence]]:
        """Sequences of the prompts (``p.n`` of each): text, token ids, or {"prompt" | "prompt_token_ids":
        ..., "multi_modal_data": {"image": ...}}. ``encode_images``: runs the vision tower on a sequence's
        pixels now (None: they are left for the engine to encode)."""
        encoded, seqs = [], []
        for prompt, p in zip(prompts, params, strict=True):
            images = []
            if isinstance(prompt, dict):
                given = (prompt.get("multi_modal_data") or {}).get("image")
                images = [] if given is None else given if isinstance(given, (list, tuple)) else [given]
                prompt = prompt.get("prompt", prompt.get("prompt_token_ids"))
            text, ids = self.encode(prompt)
            first = None
            for j in range(p.n):
                sp = p if p.seed is None or j == 0 else SamplingParams(**{**p.__dict__, "seed": p.seed + j})
                seq = Sequence(next(self._seq_ids), list(ids), sp, slot=-1, eos_ids=self.eos_ids)
                if images and first is None:
                    self.attach_images(seq, images)
                    if encode_images is not None:
                        encode_images(seq)
                    first = seq
                elif first is not None:  # n > 1: share the processed images
                    seq.prompt_ids, seq.prompt_positions = list(first.prompt_ids), first.prompt_positions
                    seq.rope_delta, seq.image_embeds = first.rope_delta, first.image_embeds
                    seq.pixel_values, seq.image_grid = first.pixel_values, first.image_grid
                seqs.append(seq)
            encoded.append((text, seqs[-1].prompt_ids))
        return encoded, seqs
