#!/usr/bin/env bash
# Usage: scripts/vllm_wheels.sh [MORE_REQUIREMENTS.txt ...]  (e.g. requirements/vllm-wheels-flashinfer.txt)
# Here (where PyPI is reachable): download the wheels of requirements/vllm-wheels.txt for the GPU machine
# (Python 3.12, x86-64) into .vllm-whl/wheels/, cut each into parts of at most PART_MIB (60) MiB, and pack the
# parts into .vllm-whl/carry-1/, carry-2/, ... of at most CARRY_MIB (62) MiB each. A device call carries
# the repository's tree too and at most 64 MiB in all, so CARRY_MIB shrinks to fit beside the tree as it is
# now (1 MiB to spare). .vllm-whl/MANIFEST.sha256 (a copy in each folder) lists, per wheel, its sha256 and
# its parts as carry-N/PART; PARTS.sha256 beside it, each part's sha256. On the GPU machine
# scripts/vllm_join.sh checks, joins and installs them.
set -euo pipefail
cd "$(dirname "$0")/.."
MiB=1048576 d=.vllm-whl
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null | awk '{s+=$1} END {print s+0}')
carry=$(( ${CARRY_MIB:-62} * MiB )) fit=$(( 63 * MiB - tree ))
(( carry > fit )) && carry=$fit
part=$(( ${PART_MIB:-60} * MiB )) room=$(( carry - 64 * 1024 ))  # 64 KiB kept for the manifest
(( part > room )) && part=$room
rm -rf "$d" && mkdir -p "$d/wheels" "$d/parts"
cat requirements/vllm-wheels.txt "$@" | sed 's/#.*//' | xargs python3 -m pip download -q --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --platform manylinux_2_35_x86_64 --platform manylinux_2_31_x86_64 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 -d "$d/wheels"
# cut: NAME.whl -> NAME.whl.p01, .p02, ... (a small wheel is one part)
for w in "$d"/wheels/*.whl; do split -b "$part" -d -a 2 --numeric-suffixes=1 "$w" "$d/parts/$(basename "$w").p"; done
# pack, largest part first, each into the first folder with room for it
used=()
while read -r size p; do
  for ((i = 0; ; i++)); do (( ${used[i]:-0} + size <= room )) && break; done
  used[i]=$(( ${used[i]:-0} + size ))
  mkdir -p "$d/carry-$((i + 1))" && mv "$d/parts/$p" "$d/carry-$((i + 1))/"
done < <(cd "$d/parts" && stat -c '%s %n' -- * | sort -k1,1nr -k2)
# manifest: SHA256  WHEEL  carry-N/WHEEL.p01 carry-M/WHEEL.p02 ...
for w in "$d"/wheels/*.whl; do
  n=$(basename "$w")
  echo "$(sha256sum "$w" | cut -d' ' -f1)  $n $(cd "$d" && printf '%s\n' carry-*/"$n".p?? | sort -t/ -k2 | tr '\n' ' ')"
done > "$d/MANIFEST.sha256"
(cd "$d" && sha256sum carry-*/*.p??) > "$d/PARTS.sha256"  # each part's own sha256
rmdir "$d/parts"
for c in "$d"/carry-*; do cp "$d/MANIFEST.sha256" "$d/PARTS.sha256" "$c/"; done
echo "tree $((tree / 1024)) KiB; parts <= $((part / MiB)) MiB; folders <= $((carry / MiB)) MiB"
du -sh "$d/wheels" "$d"/carry-* | sed 's|^|  |'
whls=("$d"/wheels/*.whl) dirs=("$d"/carry-*)
echo "${#whls[@]} wheels in ${#dirs[@]} carry folders: one device call each"
