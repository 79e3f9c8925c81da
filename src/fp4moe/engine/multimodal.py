"""Images in prompts: loading, the checkpoint's image processor, placeholder expansion, 3-D mRoPE positions.

A prompt marks each image with one ``<|image_pad|>`` (the chat template writes
``<|vision_start|><|image_pad|><|vision_end|>``); it is expanded to t*h*w/merge^2 copies, whose embeddings
come from the vision tower. Image tokens get positions (T, H, W) = start + (t, row, col) on the merged grid;
the text after an image continues at start + max(rows, cols), as Qwen3.5 does.
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fp4moe.errors import UserError

MAX_PIXELS = 32 * 1024 * 1024  # larger images are refused before decoding (decompression bombs)


class ImageError(UserError, ValueError):
    pass


def load_image(source) -> np.ndarray:
    """An RGB uint8 array [H, W, 3] from a path, bytes, ``data:`` URL, PIL image or array.
    Remote URLs are refused (nothing is fetched)."""
    from PIL import Image, UnidentifiedImageError

    Image.MAX_IMAGE_PIXELS = MAX_PIXELS // 2  # PIL raises DecompressionBombError past twice this

    if isinstance(source, np.ndarray):
        arr = source
    else:
        try:
            if isinstance(source, Image.Image):
                img = source
            elif isinstance(source, bytes):
                img = Image.open(io.BytesIO(source))
            elif isinstance(source, str) and source.startswith("data:"):
                header, _, payload = source.partition(",")
                if ";base64" not in header:
                    raise ImageError("only base64 data: URLs are supported")
                img = Image.open(io.BytesIO(base64.b64decode(payload, validate=True)))
            elif isinstance(source, str) and source.startswith(("http://", "https://")):
                raise ImageError(f"remote image URLs are not fetched: {source[:80]}")
            elif isinstance(source, (str, Path)):
                if not Path(source).is_file():
                    raise ImageError(f"image file {source} does not exist")
                img = Image.open(source)
            else:
                raise ImageError(f"unsupported image input of type {type(source).__name__}")
            arr = np.array(img.convert("RGB"))  # a writable copy
        except Image.DecompressionBombError:
            raise ImageError(f"image has too many pixels (more than {MAX_PIXELS})") from None
        except (UnidentifiedImageError, OSError, ValueError) as e:
            if isinstance(e, ImageError):
                raise
            raise ImageError(f"cannot decode image: {e}") from None
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

    def __call__(self, images: list) -> ProcessedImages:
        out = self.processor(images=[load_image(i) for i in images], return_tensors="pt")
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
