#!/usr/bin/env bash
# Download, here (where the package index is reachable), the wheels that the GPU machine's image lacks, for
# its Python 3.12 on x86-64, into .whl/ (git-ignored; name it in the device tool's `carry`).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
grep -v '^#' requirements/gpu-wheels.txt | grep . | xargs python3 -m pip download -q --no-deps \
  --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 -d .whl
ls .whl
