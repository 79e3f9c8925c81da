#!/usr/bin/env bash
# Re-measure every figure of BENCHMARKS.md's current table on one GPU (the device tool's H200 or H100: no network,
# Python 3.12 with torch/triton; the rest from the wheels carried in .whl/, as scripts/gpu_test.sh installs them).
#
#   benchmarks/verify_gpu.sh [--dry-run] STAGE...
#   STAGE: kernels | kernels2 | marked | runner | spec | server | engine | served
#          tests (= marked runner spec server) | all (= every stage)
#
# One stage per device call, each held under 9.5 minutes by a time budget (FP4MOE_STAGE_BUDGET_S, default 540 s:
# each command runs under `timeout` with what is left of it; the test stages' pytest stops 45 s before it and
# still prints its summary, failures named; the scripts save as they go, so a cut run keeps its rows):
#   kernels, kernels2  the two halves of the kernel and layer tests in JOBS (14) processes (scripts/gpu_test.sh)
#   marked, runner, spec, server   the other GPU tests, one process at a time (scripts/gpu_test.sh's parts)
#   engine  long_context.py: decode at 1K/32K/128K/512K x batch 1/16/64, fp8 KV, prefill 8K/32K/128K, each 3
#           runs (~5 min); spec_decode.py --full-size: rounds against plain steps at batch 1/8/32 with and
#           without the 32K draft vocabulary, under the profiler (~2-3 min)
#   served  serve.py twice (empty Triton cache: the first start is the cold-start figure): plain at 1/16/64
#           streams, pp 512 / tg 128, pp 128 / tg 1024 and SGLang's 8K / 1K; then MTP with forced acceptance
#           and the 32K draft vocabulary; 3 runs a row (~7-8 min)
# Results: $OUT (the device tool's return folder) or out/verify/ (git-ignored), named
# <kind>-<device>-<date>-<commit>.json, each with its provenance record; FP4MOE_COMMIT names the commit where
# git is absent (set it in the device call: FP4MOE_COMMIT=<commit> benchmarks/verify_gpu.sh engine). Then,
# here: point benchmarks/figures.toml's `file` lines at them and run `python benchmarks/report.py --write`.
# --dry-run prints the commands without running anything (no GPU needed; CI tests it).
set -uo pipefail
cd "$(dirname "$0")/.."

dry=0
stages=()
for a in "$@"; do
  case "$a" in
    --dry-run) dry=1 ;;
    kernels | kernels2 | marked | runner | spec | server | engine | served) stages+=("$a") ;;
    tests) stages+=(marked runner spec server) ;;
    all) stages+=(kernels kernels2 marked runner spec server engine served) ;;
    -h | --help) sed -n '2,26p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "unknown stage or option: $a (kernels, kernels2, marked, runner, spec, server, tests, engine, served," \
      "all; --dry-run)" >&2; exit 2 ;;
  esac
done
[ ${#stages[@]} -gt 0 ] || { echo "usage: $0 [--dry-run] STAGE... (--help lists them)" >&2; exit 2; }

commit=${FP4MOE_COMMIT:-$(git rev-parse --short=7 HEAD 2>/dev/null || echo unknown)}
commit=${commit%-dirty}
if [ -z "${FP4MOE_COMMIT:-}" ] && git rev-parse -q HEAD >/dev/null 2>&1 && [ -n "$(git status --porcelain --untracked-files=no)" ]; then
  export FP4MOE_COMMIT="$commit-dirty"
else
  export FP4MOE_COMMIT=${FP4MOE_COMMIT:-$commit}
fi
device=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | awk '{print tolower($NF)}')
device=${device:-gpu}
date=$(date -u +%F)
results=${OUT:-out/verify}
budget=${FP4MOE_STAGE_BUDGET_S:-540}
name() { echo "$results/$1-$device-$date-$commit.json"; }

stage_start=0
run() {  # run a command under what is left of the stage's budget; in --dry-run only print it
  echo "+ $*"
  [ $dry = 1 ] && return 0
  local left=$((budget - ($(date +%s) - stage_start)))
  if [ $left -le 10 ]; then
    echo "!! the stage's ${budget} s are spent: not run" >&2
    status=1
    return 1
  fi
  timeout --signal=INT --kill-after=20 "$left" "$@"
  local rc=$?
  [ $rc = 124 ] && echo "!! cut at the stage's budget (${budget} s); what it saved is kept" >&2
  [ $rc = 0 ] || status=1
  return $rc
}

setup() {
  [ $dry = 1 ] && { echo "+ (install .whl/*.whl to /tmp/site; PYTHONPATH=/tmp/site:src)"; return 0; }
  mkdir -p "$results"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl || { echo "installing the carried wheels failed (run scripts/gpu_wheels.sh here first)"; exit 2; }
  export PYTHONPATH=/tmp/site:src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
  python3 -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"' || exit 2
}

gpu_tests() {  # one part of scripts/gpu_test.sh; its pytest stops 45 s inside the stage's budget, summary printed
  run env JOBS="${JOBS:-14}" PARTS="$1" FP4MOE_TEST_BUDGET_S=$((budget - 45)) scripts/gpu_test.sh
}
stage_kernels() { gpu_tests kernels; }
stage_kernels2() { gpu_tests kernels2; }
stage_marked() { gpu_tests marked; }
stage_runner() { gpu_tests runner; }
stage_spec() { gpu_tests spec; }
stage_server() { gpu_tests server; }

stage_engine() {
  run python3 benchmarks/long_context.py --skip kernel,capacity --prefill 8192,32768,131072 \
    --decode-contexts 1024,32768,131072,524288 --batches 1,16,64 --decode-kv fp8 --repeats 3 \
    --out "$(name long-context)"
  run python3 benchmarks/spec_decode.py --full-size --ks 0 2 --batches 1 8 32 --draft-vocabs 0 32768 \
    --profile --out "$(name spec-decode-full)"
}

stage_served() {
  local cache
  cache=$([ $dry = 1 ] && echo /tmp/triton-cold || mktemp -d)
  export TRITON_CACHE_DIR=$cache  # empty: the first server's start is a cold start
  run python3 benchmarks/serve.py --spec off --concurrency 1 16 64 --decode-rows --sglang --runs 3 --long-pp 0 \
    --kv-cache-dtype fp8 --out "$results/serve-off"
  run cp "$results/serve-off/serve.json" "$(name serve)"
  run python3 benchmarks/serve.py --spec forced-vocab --concurrency 1 --sglang --runs 3 --long-pp 0 \
    --kv-cache-dtype fp8 --out "$results/serve-mtp"
  run cp "$results/serve-mtp/serve.json" "$(name serve-spec)"
}

[ "$commit" = unknown ] && echo "warning: no git and no FP4MOE_COMMIT: results will not say their commit" >&2
echo "verify_gpu: stages ${stages[*]}; commit $FP4MOE_COMMIT; results in $results; ${budget} s a stage"
setup
status=0
for s in "${stages[@]}"; do
  echo "== $s"
  stage_start=$(date +%s)
  "stage_$s"
  [ $dry = 1 ] || echo "== $s took $(($(date +%s) - stage_start)) s"
done
exit $status
