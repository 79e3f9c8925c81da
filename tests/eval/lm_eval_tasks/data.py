"""The task set's documents, read from the jsonl files beside this module (no hub, no network)."""

from __future__ import annotations

import json
from pathlib import Path

import datasets

HERE = Path(__file__).parent


def _split(name: str) -> dict[str, datasets.Dataset]:
    rows = [json.loads(line) for line in (HERE / name).read_text().splitlines() if line.strip()]
    return {"test": datasets.Dataset.from_list(rows)}


def mc(**_) -> dict[str, datasets.Dataset]:
    return _split("mc.jsonl")


def text(**_) -> dict[str, datasets.Dataset]:
    return _split("text.jsonl")


def gen(**_) -> dict[str, datasets.Dataset]:
    return _split("gen.jsonl")
