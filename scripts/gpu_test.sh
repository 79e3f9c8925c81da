#!/usr/bin/env bash
# On the GPU machine (the device tool's H200; no network): install the wheels carried in .whl/ (made here by
# scripts/gpu_wheels.sh) over the image's torch/triton/transformers, then run every GPU test: the kernel and
# layer tests (in JOBS parallel processes: most of their time is Triton compiling), then, one process at a
# time (each engine sizes its KV cache from the GPU memory left free), the other gpu-marked tests and the
# runner, speculative-sampling and server tests. Logs go to $OUT (the device tool's return folder) when set,
# else /tmp.
# Usage: [JOBS=8] [PARTS="kernels engine"] scripts/gpu_test.sh [extra pytest arguments]
# PARTS: kernels (the kernel and layer tests: ~9 min on an H100 in 8 processes, most of it compiling), engine
# (the rest); both by default. One part fits one device call of 10 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
log=${OUT:-/tmp}/gpu-test.log
jobs=${JOBS:-1}
parts=" ${PARTS:-kernels kernels2 marked runner spec server} "
parts=${parts/ engine / marked runner spec server }  # engine: every part but the kernels
parts=${parts/ kernels / kernels kernels2 }  # kernels: both halves
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/*.whl || { echo "installing the carried wheels failed (run scripts/gpu_wheels.sh here first)"; exit 2; }
export PYTHONPATH=/tmp/site:src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"' || exit 2
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$log"
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__,
"transformers", transformers.__version__)' | tee -a "$log"
echo "tree: ${FP4MOE_COMMIT:-unknown commit (set FP4MOE_COMMIT)}" | tee -a "$log"
pytest=(python3 -m pytest -q -p no:cacheprovider -rfEs --durations=15)
parallel=()
[ "$jobs" -gt 1 ] && parallel=(-n "$jobs" --dist loadfile)
# FP4MOE_TEST_BUDGET_S: past it (from now) pytest stops after the test in hand and prints its summary, failures
# named (tests/conftest.py reads FP4MOE_TEST_DEADLINE); a signal from outside would cut that summary
if [ -n "${FP4MOE_TEST_BUDGET_S:-}" ]; then
  export FP4MOE_TEST_DEADLINE=$(($(date +%s) + FP4MOE_TEST_BUDGET_S))
fi
status=0
part() {  # part NAME DESCRIPTION PYTEST-ARGS...: run one part if PARTS names it; tee -i keeps the log on a cut
  local name=$1 what=$2
  shift 2
  [[ $parts == *" $name "* ]] || return 0
  echo "== $name: $what" | tee -a "$log"
  "${pytest[@]}" "$@" "${extra[@]}" 2>&1 | tee -i -a "$log" || status=1
}
extra=("$@")
# kernels and layers: in JOBS processes, most of their time Triton compiling; two halves, each inside one call
part kernels "kernel tests, first half ($jobs processes)" "${parallel[@]}" tests/kernels/test_[a-f]*.py
part kernels2 "kernel tests, second half, and layers ($jobs processes)" "${parallel[@]}" tests/kernels/test_[g-z]*.py \
  tests/layers
# the rest one process at a time: each engine sizes its KV cache from the GPU memory left free
part marked "the other gpu-marked tests" -m gpu tests --ignore=tests/kernels --ignore=tests/layers
part runner "the CUDA runner and the KV-cache scales" -m "not gpu" tests/engine/test_cuda_runner.py \
  tests/engine/test_kv_cache_scales.py
part spec "speculation: rounds, sampling, async steps" -m "not gpu" tests/engine/test_cuda_spec.py \
  tests/engine/test_spec_sampling.py tests/engine/test_async_steps.py
# the fuzz suite (schemathesis, not carried) exercises the HTTP layer alone: the CPU's CI runs it
part server "the server on the GPU" -m "not gpu" tests/server --ignore=tests/server/test_fuzz.py
exit $status
