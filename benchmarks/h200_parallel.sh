#!/usr/bin/env bash
# Qwen-Image-2.1 served over 1, 2 and 4 H200s through diffusers' context parallelism (ditq serve --parallel cp=N),
# BF16 and fp8, at 1024x1024 with 0 and 4 references, each server on whole devices (--offload none, no
# --max-memory). Detached, so that it may outlast one shell command. From the repository root, on a host with at
# least 4 GPUs, with the machine's python3 (the wheels it lacks on PYTHONPATH):
#   bash benchmarks/h200_parallel.sh launch      # start the stages below in the background
#   bash benchmarks/h200_parallel.sh wait [S]    # follow the log for up to S seconds, or until the run ends
#   bash benchmarks/h200_parallel.sh collect     # copy results and logs to $OUT
# Stages (STAGES picks a subset, in this order):
#   tests    the parallel GPU tests (tests/serve/test_serve_parallel_gpu.py: NCCL, 2 GPUs) and the CPU ones
#   build    the full-size pipeline with random weights (tools/full_size_pipeline.py --preset full)
#   quantize the fp8 artifact (components auto, on the GPU)
#   serve    for each of $MODELS (bf16: the source; fp8: the artifact) and each degree of $DEGREES: ditq serve on
#            cuda:0 .. cuda:N-1 (--parallel cp=N, none for 1), its /health kept (devices, degree, per-rank peaks),
#            then ditq probe over $FIXTURES x $SEEDS at $STEPS steps
#   report   gate and compare every run against bf16 at cp=1, then ditq report --objective speed: the capacity
#            table's Parallel column, and "faster" in device-seconds per image where the GPU counts differ
# The run lives in $RUN (default $HOME/ditq-parallel); results go to $OUT (default
# benchmarks/results/h200-parallel). Every run's s/image is per image on N GPUs; the report states per-GPU
# throughput beside it.
set -o pipefail
OUT=${OUT:-benchmarks/results/h200-parallel}
RUN=${RUN:-$HOME/ditq-parallel}
STAGES=${STAGES:-tests build quantize serve report}
MODELS=${MODELS:-bf16 fp8}
DEGREES=${DEGREES:-1 2 4}
FIXTURES=${FIXTURES:-generate-0ref,edit-4ref}  # tools/full_size_pipeline.py's 0- and 4-reference fixtures
STEPS=${STEPS:-20}
SEEDS=${SEEDS:-2301-2304}
MODEL=$RUN/qwen-image-21-random
NOTE="Weights are random (diffusers' and transformers' default initialisation), so every image is noise: PSNR and SSIM against BF16 measure numerical deviation, not image quality. The baseline (bf16 at cp=1) was probed through ditq serve, not sealed by ditq baseline."
export PYTHONUNBUFFERED=1 CUDA_DEVICE_ORDER=PCI_BUS_ID DITQ_CACHE_DIR=$RUN/cache
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

run_stages() {
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv
  nvidia-smi topo -m
  df -h "$RUN" | tail -1
  for stage in $STAGES; do
    echo "== $stage at $(date -u +%T)"
    case "$stage" in
      tests)
        timeout "${TESTS_S:-600}" python3 -m pytest -q -p no:cacheprovider tests/serve/test_serve_parallel_gpu.py \
          tests/serve/test_serve_parallel.py tests/runtime/test_context_parallel.py tests/runtime/test_parallel.py \
          >"$RUN/parallel_tests.log" 2>&1
        echo "tests: exit $?; $(tail -1 "$RUN/parallel_tests.log")"
        ;;
      build)
        timeout 600 python3 tools/full_size_pipeline.py --preset full --device cuda --out "$MODEL" --force \
          >"$RUN/build.log" 2>&1
        echo "exit $?"
        tail -2 "$RUN/build.log"
        ;;
      quantize)
        timeout "${QUANTIZE_S:-900}" python3 -m ditq.cli quantize "$MODEL" "$RUN/artifacts/fp8" --scheme fp8 \
          --device cuda:0 --force >"$RUN/quantize-fp8.log" 2>&1
        echo "exit $?"
        tail -2 "$RUN/quantize-fp8.log"
        ;;
      serve)
        for model in $MODELS; do
          for degree in $DEGREES; do serve_probe "$model" "$degree"; done
        done
        ;;
      report)
        report
        ;;
      *) echo "unknown stage $stage" ;;
    esac
  done
  echo "== done at $(date -u +%T)"
  touch "$RUN/finished"
}

# serve_probe MODEL N: ditq serve MODEL over N GPUs (cuda:0 .. cuda:N-1; --parallel cp=N for N > 1), then ditq probe
# against it; the server's /health is kept before the probe (load) and after it (per-rank peaks).
serve_probe() {
  local name=$1 degree=$2 model=$MODEL dir port=8951 parallel=()
  [ "$name" != bf16 ] && model=$RUN/artifacts/$name
  [ "$degree" -gt 1 ] && parallel=(--parallel "cp=$degree")
  dir=$RUN/serve/$name-cp$degree
  rm -rf "$dir" && mkdir -p "$dir"
  CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((degree - 1))) python3 -m ditq.cli serve "$model" --device cuda \
    --offload none "${parallel[@]}" --port $port --on-collapse warn >"$dir/serve.log" 2>&1 &
  local pid=$!
  if python3 -c "import sys; from ditq.sweep.health import wait_healthy; r = wait_healthy('http://127.0.0.1:$port', 900); \
      sys.exit(print(r) or 1) if r else None"; then
    curl -s "http://127.0.0.1:$port/health" >"$dir/health-ready.json"
    timeout "${PROBE_S:-1200}" python3 -m ditq.cli probe --endpoint "http://127.0.0.1:$port" \
      --fixtures "$MODEL/fixtures/fixtures.json" --refs "$MODEL/fixtures/refs" --only "$FIXTURES" \
      --out "$dir/run" --seeds "$SEEDS" --steps "$STEPS" --server-pid $pid --no-progress >"$dir/probe.log" 2>&1
    echo "$name cp=$degree: probe exit $?"
    curl -s "http://127.0.0.1:$port/health" >"$dir/health-after.json"
  else
    echo "$name cp=$degree: the server never became healthy"
  fi
  kill $pid 2>/dev/null
  wait $pid 2>/dev/null
  tail -2 "$dir/serve.log"
  # after every server, so that a run stopped early still hands back what it served
  tar czf "$RUN/serve.tgz" -C "$RUN" --exclude='*/images' serve
}

# report: every run judged against bf16 at cp=1, for speed; the other degrees and fp8 are the candidates.
report() {
  local baseline=$RUN/serve/bf16-cp1/run candidates=() dir
  for dir in "$RUN"/serve/*/run; do
    [ "$dir" != "$baseline" ] && [ -f "$dir/RUN.json" ] && candidates+=("$dir")
  done
  python3 -m ditq.cli gate "${candidates[@]}" --baseline "$baseline" --allow-unsealed >"$RUN/gate.log" 2>&1
  python3 -m ditq.cli compare "${candidates[@]}" --baseline "$baseline" --allow-unsealed --no-lpips \
    >"$RUN/compare.log" 2>&1
  python3 -m ditq.cli report "${candidates[@]}" --baseline "$baseline" --allow-unsealed --objective speed \
    --note "$NOTE" --out "$RUN/report" >"$RUN/report.log" 2>&1
  echo "report: exit $?"
  tail -20 "$RUN/report.log"
  tar czf "$RUN/report.tgz" -C "$RUN" --exclude='report/grids' report gate.log compare.log report.log
}

COLLECT="run.log parallel_tests.log serve.tgz report.tgz"
EXPORTS="MODELS DEGREES FIXTURES STEPS SEEDS MODEL NOTE TESTS_S QUANTIZE_S PROBE_S"
export -f serve_probe report
# shellcheck source=benchmarks/h200_detached.sh
source "$(dirname "$0")/h200_detached.sh"
detached_main "$@"
