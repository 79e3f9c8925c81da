"""Calibration text -> token windows [num_samples, seq_len].

Sources: the packaged CPython-docs corpus (default, offline), ``--calib-file`` (plain text, or JSON
lines with a "text" field), or ``--calib-dataset NAME`` through the ``datasets`` package when a network
is available (``wikitext`` = wikitext-2-raw-v1 train, the reference recipe's choice).
"""

from __future__ import annotations

import json
from pathlib import Path

from fp4moe.data import corpus_text
from fp4moe.errors import UserError

DATASET_ALIASES = {"wikitext": ("wikitext", "wikitext-2-raw-v1", "train")}


class CalibrationDataError(UserError, ValueError):
    pass


def read_calib_file(path: str | Path) -> str:
    path = Path(path)
    if not path.is_file():
        raise CalibrationDataError(f"calibration file {path} does not exist")
    raw = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix in (".jsonl", ".json"):
        texts = []
        for lineno, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise CalibrationDataError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise CalibrationDataError(f'{path}:{lineno}: expected an object with a "text" string')
            texts.append(obj["text"])
        raw = "\n\n".join(texts)
    if not raw.strip():
        raise CalibrationDataError(f"calibration file {path} holds no text")
    return raw


def load_dataset_text(name: str) -> str:
    try:
        import datasets
    except ImportError:
        raise CalibrationDataError(
            "--calib-dataset needs the 'datasets' package (pip install fp4moe[datasets])"
        ) from None
    path, config, split = DATASET_ALIASES.get(name, (name, None, "train"))
    try:
        ds = datasets.load_dataset(path, config, split=split)
    except Exception as e:  # network or hub errors come in many types
        raise CalibrationDataError(f"could not load dataset {name!r}: {e}") from None
    return "\n\n".join(t for t in ds["text"] if t.strip())


def calibration_text(
    calib_file: str | Path | None = None, calib_dataset: str | None = None
) -> tuple[str, str]:
    """(text, description of its source)."""
    if calib_file and calib_dataset:
        raise CalibrationDataError("give either --calib-file or --calib-dataset, not both")
    if calib_file:
        return read_calib_file(calib_file), f"file {calib_file}"
    if calib_dataset:
        return load_dataset_text(calib_dataset), f"dataset {calib_dataset}"
    return corpus_text("calib"), "packaged CPython 3.11 docs (tutorial, howto, faq)"


def tokenize(tokenizer, text: str, chunk_chars: int = 1 << 16) -> list[int]:
    ids: list[int] = []
    for i in range(0, len(text), chunk_chars):
        ids.extend(tokenizer(text[i : i + chunk_chars], add_special_tokens=False)["input_ids"])
    return ids
