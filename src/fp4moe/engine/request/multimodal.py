"""Images in prompts: loading, the checkpoint's image processor, placeholder expansion, 3-D mRoPE positions.

A prompt marks each image with one ``<|image_pad|>`` (the chat template writes
``<|vision_start|><|image_pad|><|vision_end|>``); it is expanded to t*h*w/merge^2 copies, whose embeddings
come from the vision tower. Image tokens get positions (T, H, W) = start + (t, row, col) on the merged grid;
the text after an image continues at start + max(rows, cols), as Qwen3.5 does.
"""

from __future__ import annotations

import base64
import contextlib
import io
import math
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fp4moe.errors import UserError

MAX_PIXELS = 32 * 1024 * 1024  # larger images are refused before decoding (decompression bombs)


class ImageError(UserError, ValueError):
    pass


def open_image(source):
    """A lazily decoded PIL image (only its header read: size and mode known, no pixels) from a path,
    bytes, ``data:`` URL or PIL image; refused past ``MAX_PIXELS`` before any decoding. Remote URLs are
    refused (nothing is fetched)."""
    from PIL import Image, UnidentifiedImageError

    Image.MAX_IMAGE_PIXELS = MAX_PIXELS  # PIL warns past this (refused below) and raises past twice this
    with contextlib.suppress(AttributeError):
        # Pillow allocates pixels in 16 MB blocks, which glibc keeps cached in the heap once freed (the front
        # stayed ~1 GB larger after a burst of large images); blocks past glibc's 32 MB mmap threshold are
        # mapped and go back to the system the moment an image is freed
        Image.core.set_block_size(64 << 20)
    try:
        with warnings.catch_warnings():  # an image past the limit is refused below, in its own words
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = _open(source)
    except Image.DecompressionBombError:
        raise ImageError(f"image has too many pixels (more than {MAX_PIXELS})") from None
    except (UnidentifiedImageError, OSError, ValueError) as e:
        if isinstance(e, ImageError):
            raise
        raise ImageError(f"cannot decode image: {_plain(e)}") from None
    width, height = img.size
    if width * height > MAX_PIXELS:
        raise ImageError(f"image has {width}x{height} pixels, more than {MAX_PIXELS}")
    if width * height == 0:
        raise ImageError("image has no pixels")
    return img


def _open(source):
    from PIL import Image

    if isinstance(source, Image.Image):
        return source
    if isinstance(source, bytes):
        return Image.open(io.BytesIO(source))
    if isinstance(source, str) and source.startswith("data:"):
        header, _, payload = source.partition(",")
        if ";base64" not in header:
            raise ImageError("only base64 data: URLs are supported")
        return Image.open(io.BytesIO(base64.b64decode(payload, validate=True)))
    if isinstance(source, str) and source.startswith(("http://", "https://")):
        raise ImageError(f"remote image URLs are not fetched: {source[:80]}")
    if isinstance(source, (str, Path)):
        if not Path(source).is_file():
            raise ImageError(f"image file {str(source)[:200]} does not exist")
        return Image.open(source)
    raise ImageError(f"unsupported image input of type {type(source).__name__}")


def _plain(e: Exception) -> str:
    """An exception's message without object reprs (``<_io.BytesIO object at 0x…>``) a client must not see."""
    return re.sub(r"<[^<>]* at 0x[0-9a-fA-F]+>", "the image", str(e))[:200]


def plan_decode(img, max_pixels: int | None) -> tuple[int, int] | None:
    """The size an opened image is shrunk to (None: kept), with JPEG set to decode at the smallest scale at
    least that large; ``img.size`` is then the size decoding will produce (header only, nothing decoded)."""
    width, height = img.size
    if max_pixels is None or width * height <= max_pixels:
        return None
    scale = math.sqrt(max_pixels / (width * height))
    target = (max(1, int(width * scale)), max(1, int(height * scale)))
    with contextlib.suppress(ValueError, AttributeError, OSError):  # formats without draft decoding
        img.draft("RGB", target)
    return target


def decode_image(img, max_pixels: int | None = None) -> np.ndarray:
    """An opened image's RGB pixels [H, W, 3] uint8, shrunk (aspect kept) to at most ``max_pixels`` as it
    is decoded: JPEG decodes at 1/2, 1/4 or 1/8 scale (``draft``), other formats are reduced right after
    decoding, so a large image never exists in more than one full-size copy."""
    from PIL import Image

    target = plan_decode(img, max_pixels)
    try:
        img.load()
        if img.mode not in ("RGB", "L", "RGBA"):  # palette, 1-bit, CMYK, 16-bit: resize works on these
            img = img.convert("RGBA" if "A" in img.getbands() or "transparency" in img.info else "RGB")
        if target is not None and img.size != target:
            factor = min(img.size[0] // target[0], img.size[1] // target[1])
            if factor >= 2:  # box-average first: cheap, and bicubic then works on a small image
                img = img.reduce(factor)
            img = img.resize(target, Image.Resampling.BICUBIC)
        arr = np.array(img.convert("RGB"))  # a writable copy
    except Image.DecompressionBombError:
        raise ImageError(f"image has too many pixels (more than {MAX_PIXELS})") from None
    except (OSError, ValueError, SyntaxError) as e:  # truncated or corrupt data
        raise ImageError(f"cannot decode image: {_plain(e)}") from None
    return arr


def load_image(source, max_pixels: int | None = None) -> np.ndarray:
    """An RGB uint8 array [H, W, 3] from a path, bytes, ``data:`` URL, PIL image or array, shrunk to at
    most ``max_pixels`` while decoding (``decode_image``)."""
    if isinstance(source, np.ndarray):
        arr = source
    else:
        img = open_image(source)
        try:
            arr = decode_image(img, max_pixels)
        finally:
            if img is not source:  # ours: its full-size pixels freed now, not when it is collected
                img.close()
    if arr.ndim != 3 or arr.shape[-1] != 3:
        raise ImageError(f"expected an RGB image [H, W, 3], got shape {arr.shape}")
    return arr


@dataclass
class ProcessedImages:
    pixel_values: torch.Tensor  # [patches, C * T * p * p]
    grid_thw: torch.Tensor  # [n, 3] in patches

    def token_counts(self, merge: int) -> list[int]:
        return (self.grid_thw.prod(-1) // merge**2).tolist()


class ImageProcessor:
    def __init__(self, model_dir: str | Path):
        from transformers import AutoImageProcessor

        if not (Path(model_dir) / "preprocessor_config.json").exists():
            raise ImageError(f"{model_dir} has no preprocessor_config.json: it cannot take images")
        self.processor = AutoImageProcessor.from_pretrained(str(model_dir))
        size = getattr(self.processor, "size", None)
        size = dict(size) if isinstance(size, dict) else vars(size) if size is not None else {}
        # the processor shrinks larger images to this many pixels: decoding needs no more
        self.max_pixels: int | None = (
            getattr(self.processor, "max_pixels", None) or size.get("max_pixels") or size.get("longest_edge")
        )

    def __call__(self, images: list) -> ProcessedImages:
        out = self.processor(images=[load_image(i, self.max_pixels) for i in images], return_tensors="pt")
        return ProcessedImages(out["pixel_values"], out["image_grid_thw"])


def expand_image_tokens(ids: list[int], image_token_id: int, counts: list[int]) -> list[int]:
    """Replace the k-th ``image_token_id`` by counts[k] copies."""
    found = ids.count(image_token_id)
    if found != len(counts):
        raise ImageError(f"the prompt has {found} image placeholder(s) for {len(counts)} image(s)")
    out: list[int] = []
    it = iter(counts)
    for t in ids:
        out.extend([t] * next(it) if t == image_token_id else [t])
    return out


def mrope_positions(
    ids: list[int], image_token_id: int, grids: torch.Tensor, merge: int
) -> tuple[torch.Tensor, int]:
    """Positions [3, len(ids)] of an expanded prompt and the offset of the positions after it
    (decode position = token index + offset)."""
    rows: list[torch.Tensor] = []
    pos, i, k = 0, 0, 0
    n = len(ids)
    while i < n:
        if ids[i] != image_token_id:
            j = i
            while j < n and ids[j] != image_token_id:
                j += 1
            rows.append(torch.arange(pos, pos + j - i).expand(3, -1))
            pos += j - i
            i = j
            continue
        t, h, w = (int(x) for x in grids[k])
        h, w = h // merge, w // merge
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        rows.append(torch.stack([tt, hh, ww]).reshape(3, -1) + pos)
        pos += max(h, w)
        i += t * h * w
        k += 1
    positions = torch.cat(rows, dim=1)
    return positions, int(positions.max()) + 1 - n
