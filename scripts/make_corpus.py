"""Regenerate src/fp4moe/data/pydocs-*.txt.gz from Debian's python3-doc (CPython 3.11 docs, PSF license).

    apt-get install python3-doc && python scripts/make_corpus.py

calibration split: tutorial/, howto/, faq/; held-out split: reference/ (never used for calibration).
"""

import gzip
from pathlib import Path

SRC = Path("/usr/share/doc/python3.11/html/_sources")
OUT = Path(__file__).resolve().parents[1] / "src/fp4moe/data"
SPLITS = {"calib": ["tutorial", "howto", "faq"], "heldout": ["reference"]}

for split, dirs in SPLITS.items():
    docs = []
    for d in dirs:
        for f in sorted((SRC / d).glob("*.rst.txt")):
            docs.append(f.read_text(encoding="utf-8").strip())
    text = "\n\n".join(docs) + "\n"
    with gzip.GzipFile(OUT / f"pydocs-{split}.txt.gz", "wb", mtime=0) as g:
        g.write(text.encode("utf-8"))
    print(split, len(docs), "documents", len(text), "characters")
