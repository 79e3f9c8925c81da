"""Text that ships with the package: excerpts of the CPython 3.11 documentation (PSF license).

Why this text: it is available offline on every install, it mixes English technical prose with Python
code, and it is what an assistant model is asked about every day. ``calib`` (tutorial, howto, faq) is
the default calibration corpus; ``heldout`` (language reference) is never used for calibration.
Regenerate with scripts/make_corpus.py from Debian's python3-doc.
"""

import gzip
from functools import cache
from importlib import resources

SPLITS = ("calib", "heldout")


@cache
def corpus_text(split: str = "calib") -> str:
    if split not in SPLITS:
        raise ValueError(f"unknown corpus split {split!r}; choose from {', '.join(SPLITS)}")
    data = resources.files(__package__).joinpath(f"pydocs-{split}.txt.gz").read_bytes()
    return gzip.decompress(data).decode("utf-8")
