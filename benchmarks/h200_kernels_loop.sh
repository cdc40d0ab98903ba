#!/usr/bin/env bash
# The kernels' H200 run, detached so that it may outlast one shell command, from the repository root:
#   bash benchmarks/h200_kernels_loop.sh launch      # start the stages below in the background
#   bash benchmarks/h200_kernels_loop.sh wait [S]    # follow the log for up to S seconds, or until the run ends
#   bash benchmarks/h200_kernels_loop.sh collect     # copy results and logs to $OUT
# Stages (each with its own time limit; STAGES picks a subset, in this order):
#   tests   the kernels' and quantized attention's GPU tests (one Triton config per GEMM, no tuning)
#   gemm    benchmarks/kernels_bench.py: every GEMM path, the raw library ceilings, the activation quantization
#           alone, torchao where it imports (GEMM_ARGS: more arguments, e.g. --only fp8)
#   loop    benchmarks/dit_bench.py --profile: the denoising loop at 0-4 references, BF16 / ditq / torchao,
#           eager and compiled, quantized attention, a profile of each row at 0 and 4 references
# The run lives in $RUN (default /tmp/kernels-loop); results go to $OUT (default ./h200-out).
set -o pipefail
OUT=${OUT:-h200-out}
RUN=${RUN:-/tmp/kernels-loop}
STAGES=${STAGES:-tests gemm loop}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

run_stages() {
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv
  for stage in $STAGES; do
    echo "== $stage at $(date -u +%T)"
    case "$stage" in
      tests)
        DITQ_TRITON_AUTOTUNE=0 timeout "${TESTS_S:-180}" python3 -m pytest -q --noconftest -p no:cacheprovider \
          -m gpu tests/kernels/test_kernel_numerics.py tests/kernels/test_attention_gpu.py >"$RUN/gpu_tests.log" 2>&1
        tail -5 "$RUN/gpu_tests.log"
        ;;
      gemm)
        # shellcheck disable=SC2086
        timeout "${GEMM_S:-300}" python3 benchmarks/kernels_bench.py --out "$RUN/kernels_bench.json" $GEMM_ARGS \
          >"$RUN/kernels_bench.log" 2>&1
        tail -3 "$RUN/kernels_bench.log"
        ;;
      loop)
        # shellcheck disable=SC2086
        timeout "${LOOP_S:-620}" python3 benchmarks/dit_bench.py --out "$RUN/dit_bench.json" --profile \
          ${LOOP_ARGS:---budget-s 480 --loop-steps 9} >"$RUN/dit_bench.log" 2>&1
        tail -3 "$RUN/dit_bench.log"
        ;;
      *) echo "unknown stage $stage" ;;
    esac
  done
  echo "== done at $(date -u +%T)"
  touch "$RUN/finished"
}

COLLECT="gpu_tests.log kernels_bench.json kernels_bench.log dit_bench.json dit_bench.log run.log"
EXPORTS="GEMM_ARGS LOOP_ARGS TESTS_S GEMM_S LOOP_S"
# shellcheck source=benchmarks/h200_detached.sh
source "$(dirname "$0")/h200_detached.sh"
detached_main "$@"
