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
parts=" ${PARTS:-kernels engine} "
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/*.whl || { echo "installing the carried wheels failed (run scripts/gpu_wheels.sh here first)"; exit 2; }
export PYTHONPATH=/tmp/site:src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"' || exit 2
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$log"
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__,
"transformers", transformers.__version__)' | tee -a "$log"
echo "tree: ${FP4MOE_COMMIT:-unknown commit (set FP4MOE_COMMIT)}" | tee -a "$log"
pytest=(python3 -m pytest -q -p no:cacheprovider -rfEs)
parallel=()
[ "$jobs" -gt 1 ] && parallel=(-n "$jobs" --dist loadfile)
status=0
if [[ $parts == *" kernels "* ]]; then
  echo "== kernels and layers ($jobs processes)" | tee -a "$log"
  "${pytest[@]}" "${parallel[@]}" tests/kernels tests/layers "$@" 2>&1 | tee -a "$log" || status=1
fi
[[ $parts == *" engine "* ]] || exit $status
echo "== the other gpu-marked tests" | tee -a "$log"
"${pytest[@]}" -m gpu tests --ignore=tests/kernels --ignore=tests/layers "$@" 2>&1 | tee -a "$log" || status=1
echo "== runner, speculative sampling, server" | tee -a "$log"
"${pytest[@]}" -m "not gpu" tests/engine/test_cuda_runner.py tests/engine/test_cuda_spec.py \
  tests/engine/test_async_steps.py tests/engine/test_spec_sampling.py tests/engine/test_kv_cache_scales.py tests/server \
  --ignore=tests/server/test_fuzz.py "$@" 2>&1 | tee -a "$log" \
  || status=1  # the fuzz suite (schemathesis, not carried) exercises the HTTP layer: the CPU's CI runs it
exit $status
