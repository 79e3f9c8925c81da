"""Build the training text of the reference model: the CPython 3.11 documentation sources from Debian's
python3.11-doc (PSF license), every .rst.txt except reference/ -- the language reference stays held out
(it is the packaged ``heldout`` split that ``fp4moe eval`` reads). Writes .corpus/pydocs-train.txt.gz
(ignored by git; carry it to the GPU machine).

    apt-get download python3.11-doc && dpkg -x python3.11-doc_*.deb /tmp/pydoc
    python scripts/make_train_corpus.py --src /tmp/pydoc/usr/share/doc/python3.11/html/_sources
"""

import argparse
import gzip
import hashlib
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / ".corpus" / "pydocs-train.txt.gz"
HELD_OUT = "reference"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", type=Path, default=Path("/usr/share/doc/python3.11/html/_sources"))
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    files = sorted(f for f in args.src.rglob("*.rst.txt") if f.relative_to(args.src).parts[0] != HELD_OUT)
    if not files:
        raise SystemExit(f"no .rst.txt files under {args.src}")
    text = "\n\n".join(f.read_text(encoding="utf-8").strip() for f in files) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with gzip.GzipFile(args.out, "wb", mtime=0) as g:
        g.write(text.encode("utf-8"))
    digest = hashlib.sha256(args.out.read_bytes()).hexdigest()
    print(f"{len(files)} documents, {len(text):,} characters -> {args.out} (sha256 {digest})")


if __name__ == "__main__":
    main()
