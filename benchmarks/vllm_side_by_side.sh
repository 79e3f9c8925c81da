#!/usr/bin/env bash
# Issue 21 on the H200, one device call per step, back to back (the machine keeps /tmp only while warm, 30 s):
#   part N   carry [".vllm-whl/carry-N"] (N = 1..6; 6 also with ".whl"): join the vLLM wheels (scripts/vllm_join.sh);
#            the call that carries .whl installs fp4moe's server wheels and starts fp4moe's warm-up in the
#            background (a full-size dummy server started and stopped once: Triton's cache is then warm, and
#            fp4moe's served sweep starts in ~1 min instead of ~4); part 1 also builds the checkpoints (the GPU).
#            Carry part 6 first, so the warm-up overlaps the other parts.
#   ours     transformers (fp32, dequantized) and fp4moe's GPU engine on each checkpoint (after part 1)
#   matrix   each checkpoint in stock vLLM, then the compatibility table (vllm_side_by_side.py report)
#   recipe   fp4moe serve --engine vllm --exec on the default checkpoint, asked through the openai client
#   speed    benchmarks/serve.py --engine vllm (full-size dummy: pp 512 / tg 128 at 1-64, the decode-dominated
#            pp 128 / tg 1024, pp 8192 at 1, SGLang's pp 8192 / tg 1024 at 1 and 16), then the same on fp4moe
#            serve with its engine rate; 'speed vllm' / 'speed fp4moe' split it over two calls (each waits for
#            the background warm-up to end first); 'speed fp4moe-8192': fp4moe with vLLM's step budget
# Results go to $OUT. Make the parts here first: bash scripts/vllm_wheels.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/vllm-out} dir=/tmp/vsbs
mkdir -p "$out"
ours() { PYTHONPATH=/tmp/site:src${PYTHONPATH:+:$PYTHONPATH} python3 "$@"; }
vllm_env() { (unset PYTHONPATH; . /tmp/vllm-site/vllm-env.sh; export PYTHONPATH=$PYTHONPATH:$PWD/src; "$@"); }
status=0
case ${1:?usage: $0 part N|ours|matrix|recipe|speed [vllm|fp4moe|fp4moe-8192]} in
part)
  bash scripts/vllm_join.sh ".vllm-whl/carry-${2:?part number}" 2>&1 | tail -5; status=${PIPESTATUS[0]}
  if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    if [ ! -f /tmp/warm/pid ]; then  # its own process session: it outlives this call (the device notes)
      mkdir -p /tmp/warm
      PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1 setsid nohup python3 benchmarks/serve.py --spec off \
        --concurrency 1 --pp 16 --tg 4 --runs 1 --long-pp 0 --out /tmp/warm >/tmp/warm/log 2>&1 </dev/null &
      echo $! >/tmp/warm/pid
      echo "fp4moe warm-up started in the background (pid $!, log /tmp/warm/log)"
    fi
  fi
  if [ "$2" = 1 ]; then ours benchmarks/vllm_side_by_side.py make "$dir" 2>&1 | grep -v Warning | tail -12; fi
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
  vllm_env python3 benchmarks/vllm_side_by_side.py recipe "$dir/default" || status=1
  cp "$dir/default/recipe.json" "$dir/default/recipe-server.log" "$out/" 2>/dev/null
  ;;
speed)
  if [ -f /tmp/warm/pid ]; then  # the background warm-up holds the GPU until it ends (by its pid: never pgrep)
    for _ in $(seq 300); do kill -0 "$(cat /tmp/warm/pid)" 2>/dev/null || break; sleep 2; done
    grep -h "started in\|warm-up took" /tmp/warm/log /tmp/warm/server-off.log 2>/dev/null | sed 's/^/warm-up: /'
  fi
  which=${2:-both} sweep=(--spec off --concurrency 1 4 8 16 32 48 64 --runs 1 --decode-rows --sglang)
  if [ "$which" != fp4moe ]; then ours benchmarks/serve.py --engine vllm "${sweep[@]}" --out "$out/vllm" || status=1; fi
  if [ "$which" = both ] || [ "$which" = fp4moe ]; then
    ours benchmarks/serve.py "${sweep[@]}" --engine-rate --out "$out/fp4moe" || status=1
  fi
  if [ "$which" = fp4moe-8192 ]; then  # vLLM's default step budget on this GPU (ours served: 2,048)
    ours benchmarks/serve.py "${sweep[@]}" --max-num-batched-tokens 8192 --out "$out/fp4moe-8192" || status=1
  fi
  ;;
esac
exit $status
