#!/usr/bin/env bash
# On the GPU machine (the device tool's H200; no network): install the wheels carried in .whl/ (made here by
# scripts/gpu_wheels.sh) over the image's torch/triton/transformers, then run every GPU test: the
# gpu-marked tests, then the kernel, runner and speculative-sampling tests (on the GPU when it has one) and
# the server tests. Logs go to $OUT (the device tool's return folder) when set, else /tmp.
# Usage: scripts/gpu_test.sh [extra pytest arguments]
set -uo pipefail
cd "$(dirname "$0")/.."
log=${OUT:-/tmp}/gpu-test.log
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/*.whl || { echo "installing the carried wheels failed (run scripts/gpu_wheels.sh here first)"; exit 2; }
export PYTHONPATH=/tmp/site:src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"' || exit 2
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$log"
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__,
"transformers", transformers.__version__)' | tee -a "$log"
echo "tree: ${FP4MOE_COMMIT:-unknown commit (set FP4MOE_COMMIT)}" | tee -a "$log"
status=0
echo "== gpu-marked tests" | tee -a "$log"
python3 -m pytest -q -p no:cacheprovider -rfEs -m gpu tests "$@" 2>&1 | tee -a "$log" || status=1
echo "== kernels, runner, speculative sampling, server" | tee -a "$log"
python3 -m pytest -q -p no:cacheprovider -rfEs -m "not gpu" tests/kernels tests/engine/test_cuda_runner.py \
  tests/engine/test_cuda_spec.py tests/engine/test_async_steps.py tests/layers/test_fused_linear.py \
  tests/engine/test_spec_sampling.py tests/server --ignore=tests/server/test_fuzz.py "$@" 2>&1 | tee -a "$log" \
  || status=1  # the fuzz suite (schemathesis, not carried) exercises the HTTP layer: the CPU's CI runs it
exit $status
