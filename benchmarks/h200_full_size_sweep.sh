#!/usr/bin/env bash
# The real job at real size on H200s: a full-size Qwen-Image-2.1 pipeline (random weights, written by
# benchmarks/full_size_pipeline.py) swept through ditq for BF16, w8a16, w8a8 and fp8 at 1024x1024 with 0-4
# reference images, once on the whole device and once under a 24 GiB budget with the offload ladder.
# Run from the repository root with the machine's python3 (diffusers, compressed-tensors, pydantic, fastapi,
# uvicorn, python-multipart on its path):
#   bash benchmarks/h200_full_size_sweep.sh launch          # one call: GPU tests beside the build, then start
#   bash benchmarks/h200_full_size_sweep.sh checks          # GPU tests + the tiny pipeline's chain on the GPU
#   bash benchmarks/h200_full_size_sweep.sh build           # the full-size pipeline and its fixtures
#   bash benchmarks/h200_full_size_sweep.sh start           # both sweeps, detached (GPU 0 whole, GPU 1 24 GiB)
# One GPU: WHOLE_DEVICE=cuda:0 BUDGET_DEVICE=cuda:0 runs them one after the other; SWEEPS=budget (or whole) starts one.
#   bash benchmarks/h200_full_size_sweep.sh budget-serve    # one scheme under 24 GiB without a baseline: quantize,
#       then serve + probe up the offload ladder (model, then block for what ran out of memory); SERVE_SCHEME=w8a16
# SWEEPS=whole,serve-budget runs the whole-device sweep, then budget-serve (the 24 GiB baseline takes 11 minutes).
#   bash benchmarks/h200_full_size_sweep.sh wait [S]        # follow them for up to S seconds
#   bash benchmarks/h200_full_size_sweep.sh collect         # reports, verdicts, charts, logs -> $OUT
# Sweeps run detached because they outlast one shell session; each is one `ditq sweep` command (below).
set -o pipefail
OUT=${OUT:-h200-out}
WORK=${WORK:-/root/ditq-full}
MODEL=$WORK/qwen-image-21-random
# 10 denoising steps (the pipeline's default is 40) and two seeds under the budget, where every request also moves
# the 17.5 GB text encoder: what fits in a session's device time (see benchmarks/results/h200-full-size/README.md)
STEPS=${STEPS:-10}
SEEDS=${SEEDS:-2301-2304}
BUDGET_SEEDS=${BUDGET_SEEDS:-2301-2302}
SCHEMES=${SCHEMES:-w8a16,w8a8,fp8}
BUDGET_SCHEMES=${BUDGET_SCHEMES:-$SCHEMES}
SWEEPS=${SWEEPS:-whole,budget}
WHOLE_DEVICE=${WHOLE_DEVICE:-cuda:0}
BUDGET_DEVICE=${BUDGET_DEVICE:-cuda:1}
NOTE="Weights are random (diffusers' and transformers' default initialisation), so every image is noise: PSNR and SSIM against BF16 measure numerical deviation, not image quality."
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1 CUDA_DEVICE_ORDER=PCI_BUS_ID DITQ_CACHE_DIR=$WORK/cache
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export OUT WORK MODEL STEPS NOTE SCHEMES
ditq() { python3 -m ditq.cli "$@"; }
sweep() {  # sweep NAME DEVICE SEEDS [more ditq sweep options]: the command behind each committed report
  local name=$1 device=$2 seeds=$3
  shift 3
  ditq sweep "$MODEL" --schemes "$SCHEMES" --fixtures "$MODEL/fixtures/fixtures.json" \
    --refs "$MODEL/fixtures/refs" --out "$WORK/$name" --seeds "$seeds" --steps "$STEPS" --device "$device" \
    --health-timeout 900 --note "$NOTE" "$@"
}
export -f ditq sweep

case "$1" in
  launch)
    # (tests/serve/test_serve_openai_client.py needs the openai client, which that machine lacks)
    CUDA_VISIBLE_DEVICES=${BUDGET_DEVICE#cuda:} timeout "${TESTS_S:-300}" python3 -m pytest -q -p no:cacheprovider \
      -m gpu tests/serve/test_serve_gpu.py tests/serve/test_serve_units.py tests/runtime/test_runtime_gpu.py \
      tests/kernels/test_kernel_numerics.py tests/test_quantize_gpu.py >"$OUT/gpu_tests.log" 2>&1 &
    BUILD_DEVICE=$WHOLE_DEVICE bash "$0" build
    wait
    tail -3 "$OUT/gpu_tests.log"
    bash "$0" start
    ;;
  checks)
    nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv 2>&1 | tee "$OUT/checks.log"
    df -h "$WORK" | tee -a "$OUT/checks.log"
    python3 -c "import torch, diffusers, transformers, compressed_tensors; print(torch.__version__, diffusers.__version__, transformers.__version__, compressed_tensors.__version__)" 2>&1 | tee -a "$OUT/checks.log"
    # (tests/serve/test_serve_openai_client.py needs the openai client, which that machine lacks)
    timeout "${TESTS_S:-240}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/serve/test_serve_gpu.py \
      tests/serve/test_serve_units.py tests/runtime/test_runtime_gpu.py \
      2>&1 | tee "$OUT/gpu_tests.log" | tail -25
    rm -rf "$WORK/tiny" "$WORK/tiny-w8a8" "$WORK/tiny-sweep"
    python3 benchmarks/full_size_pipeline.py --preset tiny --device cuda --out "$WORK/tiny" 2>&1 | tail -3
    ditq quantize "$WORK/tiny" "$WORK/tiny-w8a8" --scheme w8a8 --device cuda 2>&1 | tail -2
    for offload in none model block; do
      ditq generate "$WORK/tiny-w8a8" --device cuda --offload "$offload" --prompt "a red square" --steps 2 \
        --image "$WORK/tiny/fixtures/refs/$(ls "$WORK/tiny/fixtures/refs" | head -1)" --out "$WORK/tiny-$offload.png" \
        2>&1 | grep -E "kernels|load|total|peak|Error" | tr '\n' ' '
      echo "<- generate --offload $offload"
    done
    # the whole chain on the GPU at the tiny size, under a memory budget, through the offload ladder
    MODEL=$WORK/tiny STEPS=2 timeout "${TINY_S:-300}" bash -c \
      'sweep tiny-sweep cuda:0 2301-2302 --schemes w8a8 --offload auto --max-memory 4GiB' >"$OUT/tiny_sweep.log" 2>&1
    tail -8 "$OUT/tiny_sweep.log"
    tar czf "$OUT/tiny_sweep.tgz" -C "$WORK" --exclude='*/artifact' --exclude='*/images' tiny-sweep 2>/dev/null
    ;;
  build)
    python3 benchmarks/full_size_pipeline.py --preset full --device "${BUILD_DEVICE:-cuda}" --out "$MODEL" --force \
      2>&1 | tee "$OUT/build.log" | tail -12
    du -sh "$MODEL"/* | tee -a "$OUT/build.log"
    ;;
  start)
    # the sweeps run the code as it was when they started
    rm -rf "$WORK/src" && mkdir -p "$WORK/src" && cp -r ditq benchmarks "$WORK/src/"
    cd "$WORK/src" || exit 1
    export PYTHONPATH=$WORK/src${PYTHONPATH:+:$PYTHONPATH}
    whole="sweep sweep-whole $WHOLE_DEVICE $SEEDS >$WORK/sweep-whole.log 2>&1"
    budget="sweep sweep-24gib $BUDGET_DEVICE $BUDGET_SEEDS --max-memory 24GiB --offload auto --schemes $BUDGET_SCHEMES \
      >$WORK/sweep-24gib.log 2>&1"
    case "$SWEEPS" in
      whole) budget=true ;;
      budget) whole=true ;;
      whole,serve-budget) budget="bash $PWD/benchmarks/h200_full_size_sweep.sh budget-serve" ;;
    esac
    if [ "$WHOLE_DEVICE" = "$BUDGET_DEVICE" ]; then  # one GPU: one after the other, so timings do not contend
      setsid nohup bash -c "$whole; $budget" >/dev/null 2>&1 </dev/null &
    else
      setsid nohup bash -c "$whole" >/dev/null 2>&1 </dev/null &
      setsid nohup bash -c "$budget" >/dev/null 2>&1 </dev/null &
    fi
    sleep 2
    echo "started ($SWEEPS): sweep-whole on $WHOLE_DEVICE (seeds $SEEDS), sweep-24gib on $BUDGET_DEVICE" \
      "(seeds $BUDGET_SEEDS, schemes $BUDGET_SCHEMES), steps $STEPS"
    ;;
  budget-serve)
    # What a user runs by hand for one scheme under the budget: the sweep's own commands without its baseline
    # (--on-collapse warn as the sweep's servers: random weights make images the gate calls collapsed).
    scheme=${SERVE_SCHEME:-w8a16}
    dir=$WORK/serve-24gib-$scheme
    mkdir -p "$dir/logs"
    [ -d "$dir/artifact" ] ||
      ditq quantize "$MODEL" "$dir/artifact" --scheme "$scheme" --device "$BUDGET_DEVICE" >"$dir/logs/quantize.log" 2>&1
    retry=()
    for offload in model block; do
      python3 -m ditq.cli serve "$dir/artifact" --device "$BUDGET_DEVICE" --max-memory 24GiB --offload "$offload" --port 8931 \
        --on-collapse warn \
        >"$dir/logs/serve-$offload.log" 2>&1 &
      pid=$!
      python3 -c "import sys; from ditq.sweep.health import wait_healthy; r = wait_healthy('http://127.0.0.1:8931', 900); \
        sys.exit(print(r) or 1) if r else None" || { kill $pid; continue; }
      curl -s http://127.0.0.1:8931/health >"$dir/logs/health-$offload.json" 2>/dev/null || true
      ditq probe --endpoint http://127.0.0.1:8931 --fixtures "$MODEL/fixtures/fixtures.json" --refs "$MODEL/fixtures/refs" \
        --out "$dir/run" --seeds "${BUDGET_SEEDS%%-*}" --steps "$STEPS" --server-pid $pid --no-progress "${retry[@]}" \
        >"$dir/logs/probe-$offload.log" 2>&1
      kill $pid; wait $pid
      retry=(--retry-out-of-memory)
      grep -q out_of_memory "$dir/run/records.jsonl" 2>/dev/null || break
    done
    ;;
  wait)
    deadline=$((SECONDS + ${2:-540}))
    while [ $SECONDS -lt $deadline ] && pgrep -f "ditq.cli sweep|budget-serve" >/dev/null; do sleep 10; done
    for name in sweep-whole sweep-24gib; do
      [ -f "$WORK/$name.log" ] || continue
      echo "== $name"; grep -v "^\s*$" "$WORK/$name.log" | tail -12
    done
    for dir in "$WORK"/serve-24gib-*; do
      [ -d "$dir" ] && echo "== $(basename "$dir")" && tail -n 3 "$dir"/logs/*.log
    done
    nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv,noheader
    pgrep -f "ditq.cli sweep|budget-serve" >/dev/null && echo "sweeps still running" || echo "sweeps finished"
    ;;
  collect)
    for name in sweep-whole sweep-24gib; do
      [ -d "$WORK/$name" ] || continue
      if [ ! -f "$WORK/$name/report/verdict.json" ]; then  # stopped early: judge the candidates that finished
        done_runs=$(for c in w8a16 w8a8 fp8; do [ -f "$WORK/$name/$c/run/compare.json" ] && echo "$WORK/$name/$c"; done)
        # shellcheck disable=SC2086
        [ -n "$done_runs" ] && timeout 120 python3 -m ditq.cli report $done_runs --baseline "$WORK/$name/baseline" \
          --out "$WORK/$name/report" --baseline-attempts "$WORK/$name/logs/baseline-attempts.json" \
          --note "$NOTE Partial: the sweep had not finished when its results were collected." | tail -4
      fi
      # no artifacts, and no noise images: the runs' PNGs, the report's grids and report.html (which inlines them)
      tar czf "$OUT/$name.tgz" -C "$WORK" --exclude="$name/*/artifact" --exclude="$name/*/run/images" \
        --exclude="$name/baseline/images" --exclude="$name/report/grids" --exclude="$name/report/report.html" \
        "$name" "$name.log"
    done
    for dir in "$WORK"/serve-24gib-*; do
      [ -d "$dir" ] && tar czf "$OUT/$(basename "$dir").tgz" -C "$WORK" --exclude='*/artifact' --exclude='*/run/images' \
        "$(basename "$dir")"
    done
    cp "$WORK"/sweep-*.log "$OUT/" 2>/dev/null
    ls -la "$OUT"
    ;;
  *)
    echo "usage: $0 checks | build | start | wait [seconds] | collect" >&2
    exit 2
    ;;
esac
