#!/usr/bin/env bash
# Issue 21 on the H200, one device call per step, back to back (the machine keeps /tmp only while warm, 30 s):
#   part N   carry [".vllm-whl/carry-N"] (N = 1..6; 6 also with ".whl"): join the vLLM wheels (scripts/vllm_join.sh);
#            part 1 also builds the checkpoints, part 6 installs vLLM and runs fp4moe + transformers on them
#   matrix   each checkpoint in stock vLLM, then the compatibility table (vllm_side_by_side.py report)
#   recipe   fp4moe serve --engine vllm --exec on the default checkpoint, asked through the openai client
#   speed    benchmarks/serve.py --engine vllm (full-size dummy, pp 512 / tg 128 at 1-64 and pp 8192 at 1), then
#            the same on fp4moe serve with its engine rate; 'speed vllm' / 'speed fp4moe' split it over two calls
# Results go to $OUT. Make the parts here first: bash scripts/vllm_wheels.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/vllm-out} dir=/tmp/vsbs
mkdir -p "$out"
ours() { PYTHONPATH=/tmp/site:src${PYTHONPATH:+:$PYTHONPATH} python3 "$@"; }
vllm_env() { (unset PYTHONPATH; . /tmp/vllm-site/vllm-env.sh; export PYTHONPATH=$PYTHONPATH:$PWD/src; "$@"); }
status=0
case ${1:?usage: $0 part N|matrix|recipe|speed} in
part)
  bash scripts/vllm_join.sh ".vllm-whl/carry-${2:?part number}" 2>&1 | tail -5; status=${PIPESTATUS[0]}
  if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  fi
  case $2 in
  1) ours benchmarks/vllm_side_by_side.py make "$dir" 2>&1 | grep -v Warning | tail -12 ;;
  6) ours benchmarks/vllm_side_by_side.py ours "$dir" 2>&1 | grep -v "Loading weights\|falling back" | tail -12 ;;
  esac
  ;;
matrix)
  vllm_env python3 benchmarks/vllm_side_by_side.py vllm "$dir"
  ours benchmarks/vllm_side_by_side.py report "$dir" | tee "$out/matrix.md"
  mkdir -p "$out/matrix"
  for d in "$dir"/*/; do n=$(basename "$d"); cp "$d"/vllm.log "$out/matrix/$n-vllm.log" 2>/dev/null; done
  cp "$dir/matrix.json" "$out/"
  ;;
recipe)
  vllm_env python3 benchmarks/vllm_side_by_side.py recipe "$dir/default" || status=1
  cp "$dir/default/recipe.json" "$dir/default/recipe-server.log" "$out/" 2>/dev/null
  ;;
speed)
  which=${2:-both} sweep=(--spec off --concurrency 1 4 8 16 32 48 64 --runs 1)
  if [ "$which" != fp4moe ]; then ours benchmarks/serve.py --engine vllm "${sweep[@]}" --out "$out/vllm" || status=1; fi
  if [ "$which" != vllm ]; then ours benchmarks/serve.py "${sweep[@]}" --engine-rate --out "$out/fp4moe" || status=1; fi
  ;;
esac
exit $status
