#!/usr/bin/env bash
# Issue 21 on the H200, one device call per step, back to back (the machine keeps /tmp only while warm, 30 s):
#   part N   carry [".vllm-whl/carry-N"] (N = 1..6; 6 also with ".whl"): join the vLLM wheels (scripts/vllm_join.sh);
#            the call that carries .whl installs fp4moe's server wheels and starts fp4moe's warm-up in the
#            background (a full-size dummy server started and stopped once: Triton's cache is then warm, and
#            fp4moe's served sweep starts in ~1 min instead of ~4); part 1 also builds the checkpoints (the GPU).
#            Carry part 6 first, so the warm-up overlaps the other parts.
#   mtp      'mtp train': a small model with a trained MTP head (the reference recipe, experts 128 wide for
#            Marlin) quantized by fp4moe (~5 min, GPU; after 'part 6'), in the background (its own process
#            session: the next parts' calls run beside it); 'mtp check' (after the vLLM install) waits for it,
#            then vLLM's MTP speculation on it against our eval's predicted acceptance on vLLM's own tokens
#   ours     transformers (fp32, dequantized) and fp4moe's GPU engine on each checkpoint (after part 1)
#   matrix   each checkpoint in stock vLLM, then the compatibility table (vllm_side_by_side.py report)
#   recipe   fp4moe serve --engine vllm --exec on the default checkpoint, asked through the openai client; then
#            (SPEED=1, the default) starts 'speed vllm' in the background, for 'speed wait' to collect
#   speed    benchmarks/serve.py on the full-size dummy model (pp 512 / tg 128 at 1-64, decode at 1K and 32K
#            context at 1, 16, 64 with its steady rate, pp 8192 at 1, SGLang's pp 8192 / tg 1024 at 1 and 16):
#            'speed vllm' (stock vLLM through fp4moe's recipe: fp8 KV, its 8,192-token step budget),
#            'speed wait' (waits up to ~9.5 min for the background 'speed vllm' and collects it),
#            'speed fp4moe' (fp4moe serve with the same KV dtype and step budget, then its engine rate)
#   graphs   fp4moe serve's pp 512 / tg 128 at 16, 32, 64 streams with prefill graphs of at most 2,048 rows
#            and of 8,192 (--prefill-graph-tokens; the default is the step budget), same KV dtype and step
#            budget as 'speed'
# Results go to $OUT. Make the parts here first: bash scripts/vllm_wheels.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/vllm-out} dir=/tmp/vsbs
mkdir -p "$out"
ours() { PYTHONPATH=/tmp/site:src${PYTHONPATH:+:$PYTHONPATH} python3 "$@"; }
vllm_env() { (unset PYTHONPATH; . /tmp/vllm-site/vllm-env.sh; export PYTHONPATH=$PYTHONPATH:$PWD/src; "$@"); }
# the same sweep on both servers; fp4moe with vLLM's KV dtype and step budget on this GPU
sweep=(--spec off --concurrency 1 4 8 16 32 48 64 --runs 1 --sglang --context-rows 1024 32768 --max-model-len 36864)
fp4moe_flags=(--kv-cache-dtype fp8 --max-num-batched-tokens 8192)
detach() {  # DIR SCRIPT ARGS...: python3 SCRIPT ARGS in its own process session (it outlives the device call
  # that starts it), its log and pid in DIR
  local d=$1; shift
  mkdir -p "$d"
  PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1 setsid nohup python3 "$@" >"$d/log" 2>&1 </dev/null &
  echo $! >"$d/pid"
  echo "started in the background: $* (pid $!, log $d/log)"
}
background() { local d=$1; shift; detach "$d" benchmarks/serve.py "$@" --out "$d"; }  # DIR ARGS: serve.py
wait_pid() {  # a background job by its pid file (never pgrep: it matched the waiting shell itself), <= $2 s
  [ -f "$1" ] || return 0
  for _ in $(seq $(($2 / 2))); do kill -0 "$(cat "$1")" 2>/dev/null || return 0; sleep 2; done
  return 1
}
status=0
case ${1:?usage: $0 part N|mtp train|check|ours|matrix|recipe|speed vllm|wait|fp4moe|graphs} in
part)
  bash scripts/vllm_join.sh ".vllm-whl/carry-${2:?part number}" 2>&1 | tail -5; status=${PIPESTATUS[0]}
  if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    if [ "${WARM:-1}" = 1 ] && [ ! -f /tmp/warm/pid ]; then  # fp4moe's warm-up
      background /tmp/warm --spec off --concurrency 1 --pp 16 --tg 4 --runs 1 --long-pp 0 --max-model-len 36864 \
        "${fp4moe_flags[@]}"
    fi
  fi
  if [ "$2" = 1 ]; then ours benchmarks/vllm_side_by_side.py make "$dir" 2>&1 | grep -v Warning | tail -12; fi
  ;;
mtp)
  case ${2:?mtp train|check} in
  train) detach /tmp/mtp-train benchmarks/vllm_side_by_side.py train "$dir" ;;
  check)
    wait_pid /tmp/mtp-train/pid 420 || { echo "mtp train still runs"; exit 1; }
    grep -v Warning /tmp/mtp-train/log | tail -4; cp /tmp/mtp-train/log "$out/mtp-train.log"
    vllm_env python3 benchmarks/vllm_side_by_side.py mtp-vllm "$dir/trained" > "$out/mtp-vllm.log" 2>&1 || status=1
    tail -3 "$out/mtp-vllm.log"
    ours benchmarks/vllm_side_by_side.py mtp-ours "$dir/trained" 2>&1 | tail -3
    cp "$dir/trained/mtp.json" "$dir/trained/mtp-vllm.json" "$out/" 2>/dev/null
    ;;
  esac
  ;;
ours)
  ours benchmarks/vllm_side_by_side.py ours "$dir" 2>&1 | grep -v "Loading weights\|falling back" | tail -12
  ;;
matrix)
  vllm_env python3 benchmarks/vllm_side_by_side.py vllm "$dir"
  ours benchmarks/vllm_side_by_side.py report "$dir" | tee "$out/matrix.md"
  mkdir -p "$out/matrix"
  for d in "$dir"/*/; do n=$(basename "$d"); cp "$d"/vllm.log "$out/matrix/$n-vllm.log" 2>/dev/null; done
  cp "$dir/matrix.json" "$out/"
  ;;
recipe)
  wait_pid /tmp/warm/pid 300 || echo "fp4moe's warm-up still runs"
  vllm_env python3 benchmarks/vllm_side_by_side.py recipe "$dir/default" || status=1
  cp "$dir/default/recipe.json" "$dir/default/recipe-server.log" "$out/" 2>/dev/null
  if [ "${SPEED:-1}" = 1 ]; then background /tmp/speed-vllm --engine vllm "${sweep[@]}"; fi  # 'speed wait'
  ;;
speed)
  if ! wait_pid /tmp/warm/pid 600; then echo "fp4moe's warm-up still runs"; exit 1; fi
  grep -h "started in\|warm-up took" /tmp/warm/log /tmp/warm/server-off.log 2>/dev/null | sed 's/^/warm-up: /'
  case ${2:?speed vllm|wait|fp4moe} in
  vllm) ours benchmarks/serve.py --engine vllm "${sweep[@]}" --out "$out/vllm" || status=1 ;;
  wait)
    wait_pid /tmp/speed-vllm/pid "${WAIT_S:-570}" || { echo "still running"; status=3; }
    mkdir -p "$out/vllm" && cp -r /tmp/speed-vllm/. "$out/vllm/"
    tail -40 /tmp/speed-vllm/log
    ;;
  fp4moe) ours benchmarks/serve.py "${sweep[@]}" "${fp4moe_flags[@]}" --engine-rate --out "$out/fp4moe" || status=1 ;;
  esac
  ;;
graphs)
  if ! wait_pid /tmp/warm/pid 300; then echo "fp4moe's warm-up still runs"; exit 1; fi
  for rows in 2048 8192; do
    ours benchmarks/serve.py --spec off --concurrency 16 32 64 --runs 1 --long-pp 0 --max-model-len 36864 \
      "${fp4moe_flags[@]}" --prefill-graph-tokens $rows --out "$out/graphs-$rows" 2>&1 | tail -8 || status=1
  done
  ;;
esac
exit $status
