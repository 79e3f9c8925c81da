#!/usr/bin/env bash
# On the GPU machine: gather the wheel parts carried in one folder made by scripts/vllm_wheels.sh (say
# .vllm-whl/carry-3) into PARTS (/tmp/vllm-parts, which outlives back-to-back device calls), drop any part whose
# sha256 is off (PARTS.sha256), join every wheel whose parts are all there and check it (MANIFEST.sha256). Once
# every wheel is there, install them all with --no-deps into TARGET (/tmp/vllm-site), write TARGET/vllm-env.sh
# (source it to serve) and check that vLLM's server imports (CHECK=0 skips that).
# Prints what is still missing; exits 0 once installed, 3 while parts are missing, 1 on a bad wheel.
# Usage: scripts/vllm_join.sh CARRY_DIR [PARTS [TARGET]]
set -euo pipefail
src=${1:?usage: $0 CARRY_DIR [PARTS [TARGET]]} parts=${2:-/tmp/vllm-parts} target=${3:-/tmp/vllm-site}
mkdir -p "$parts"
[ -d "$src" ] && cp "$src"/* "$parts"/
[ -f "$parts/MANIFEST.sha256" ] || { echo "no MANIFEST.sha256 in $src or $parts"; exit 3; }
[ -f "$parts/PARTS.sha256" ] || { echo "no PARTS.sha256 in $src or $parts"; exit 3; }
while read -r sum p; do  # a part spoilt on the way is dropped, to be carried again
  f=$parts/${p#*/}
  if [ -f "$f" ] && [ "$(sha256sum < "$f" | cut -d' ' -f1)" != "$sum" ]; then echo "BAD PART $p"; rm "$f"; fi
done < "$parts/PARTS.sha256"
missing=()
while read -r sum whl list; do
  [ -f "$parts/$whl" ] && continue                      # joined by an earlier call
  files=() lack=()
  for p in $list; do
    if [ -f "$parts/${p#*/}" ]; then files+=("$parts/${p#*/}"); else lack+=("$p"); fi
  done
  if (( ${#lack[@]} )); then missing+=("${lack[@]}"); continue; fi
  cat "${files[@]}" > "$parts/$whl.tmp"
  if [ "$(sha256sum < "$parts/$whl.tmp" | cut -d' ' -f1)" != "$sum" ]; then
    echo "BAD CHECKSUM: $whl (its parts removed: carry them again)"; rm -f "$parts/$whl.tmp" "${files[@]}"; exit 1
  fi
  mv "$parts/$whl.tmp" "$parts/$whl" && rm -f "${files[@]}"
done < "$parts/MANIFEST.sha256"
have=$(find "$parts" -maxdepth 1 -name '*.whl' | wc -l) want=$(grep -c . "$parts/MANIFEST.sha256")
if (( ${#missing[@]} )); then
  echo "$have of $want wheels joined; still to carry: $(printf '%s\n' "${missing[@]}" | cut -d/ -f1 | sort -uV | tr '\n' ' ')"
  printf '  missing %s\n' "${missing[@]:0:10}"
  (( ${#missing[@]} > 10 )) && echo "  ... ${#missing[@]} parts in all"
  exit 3
fi
echo "all $want wheels joined and checked; installing into $target"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$target" \
  "$parts"/*.whl
# the environment to serve in: NVLink multicast off (the device notes' three variables; vLLM's own users of it:
# torch/NCCL symmetric-memory collectives and, with flashinfer, its default "mnnvl" fused all-reduce), no
# phoning home, and without flashinfer (carried only on request) its sampler off
sampler=VLLM_USE_FLASHINFER_SAMPLER=0 flag="--gdn-prefill-backend triton "
[ -d "$target/flashinfer" ] && sampler="" flag=""
cat > "$target/vllm-env.sh" <<EOF
export PYTHONPATH=$target\${PYTHONPATH:+:\$PYTHONPATH} PATH=\$PATH:$target/bin
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export VLLM_ALLREDUCE_USE_SYMM_MEM=0 VLLM_USE_NCCL_SYMM_MEM=0 VLLM_FLASHINFER_ALLREDUCE_BACKEND=trtllm
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $sampler
EOF
echo "serve with: . $target/vllm-env.sh; python3 -m vllm.entrypoints.cli.main serve MODEL $flag..."
[ "${CHECK:-1}" = 0 ] && exit 0
# shellcheck disable=SC1091
. "$target/vllm-env.sh"
python3 -c 'import vllm, vllm.entrypoints.openai.api_server as s; print("vllm", vllm.__version__, "imports from", s.__file__)'
