#!/usr/bin/env bash
# On the GPU machine (the device tool's H200 or H100; no network): install the wheels carried in .whl/ (made here
# by scripts/gpu_wheels.sh) over the image's torch/triton/transformers, then run the GPU tests in parts, each
# sized to end inside one device call of 10 minutes:
#   kernels   tests/kernels/test_[a-f]*   in JOBS processes (most of their time is Triton compiling)
#   kernels2  tests/kernels/test_[g-z]* and tests/layers, in JOBS processes
#   marked    the other gpu-marked tests          \
#   runner    the CUDA runner, the KV-cache scales  | one process at a time: each engine sizes its KV cache
#   spec      speculation: rounds, sampling, async  | from the GPU memory left free
#   server    the server on the GPU                /
# Logs go to $OUT (the device tool's return folder) when set, else /tmp; pytest names every failure (-rfE).
# FP4MOE_TEST_BUDGET_S=N: N seconds from the start, pytest stops after the test in hand and still prints its
# summary (a part cut from outside by a signal loses it).
# Usage: [JOBS=14] [PARTS="kernels kernels2 marked runner spec server"] [FP4MOE_TEST_BUDGET_S=540] \
#        scripts/gpu_test.sh [extra pytest arguments]      (PARTS=engine: every part but the two kernel halves)
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
# (tests/eval/test_lm_eval.py holds no gpu-marked test -- its server runs on the CPU, and CI runs it -- so here it
# only showed as a skip: lm-eval and its needs, datasets and pyarrow among them, are not among the carried wheels)
part marked "the other gpu-marked tests" -m gpu tests --ignore=tests/kernels --ignore=tests/layers \
  --ignore=tests/eval/test_lm_eval.py
part runner "the CUDA runner and the KV-cache scales" -m "not gpu" tests/engine/test_cuda_runner.py \
  tests/engine/test_kv_cache_scales.py
part spec "speculation: rounds, sampling, async steps" -m "not gpu" tests/engine/test_cuda_spec.py \
  tests/engine/test_spec_sampling.py tests/engine/test_async_steps.py
# the fuzz suite (schemathesis, not carried) exercises the HTTP layer alone: the CPU's CI runs it
part server "the server on the GPU" -m "not gpu" tests/server --ignore=tests/server/test_fuzz.py
exit $status
