#!/usr/bin/env bash
# Issue 46's GPU runs on one H100 (or H200: name the card with every result), detached so that they may outlast one
# shell command. From the repository root, with the machine's python3 (the wheels it lacks on PYTHONPATH):
#   bash benchmarks/h100_four_bit.sh launch | wait [S] | collect      (benchmarks/h200_detached.sh's verbs)
# Stages (STAGES picks a subset, in this order):
#   tests    the 4-bit kernel paths' GPU tests (tests/kernels, -k w4)
#   doctor   ditq doctor on their paths at every Linear geometry of the full-size transformer and text encoder, grouped
#            as ditq quantize groups them
#   tiny     the chain on the GPU at the tiny preset: ditq sweep --schemes w4a8,w4a16 --offload auto --max-memory 4GiB
#            (quantize, verify, doctor, load, serve, compare: every 4-bit stage on CUDA)
#   kernels  benchmarks/kernels_bench.py --shapes four-bit: the 4-bit paths against BF16 cuBLAS and ditq fp8
#            (KERNEL_SCHEMES: the schemes timed, default fp8,w4a8,w4a16)
#   ditbench benchmarks/dit_bench.py: the full-size DiT's denoising loop, BF16 / fp8 / w4a8 / w4a16, compiled (and
#            DITBENCH_ARGS), 0-4 references at 1024x1024
# The run lives in $RUN (default /root/ditq-four-bit); results go to $OUT.
set -o pipefail
OUT=${OUT:-h100-out}
RUN=${RUN:-/root/ditq-four-bit}
STAGES=${STAGES:-tests doctor tiny kernels ditbench}
TREE=${TREE:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
GEOMETRIES=${GEOMETRIES:-1152x4304 4304x1152 4096x1024 4096x4096 4096x12288 12288x4096 64x4096 4096x64}
DITBENCH_ARGS=${DITBENCH_ARGS:---variants bf16,fp8,w4a8,w4a16 --modes compiled}
DITBENCH_BUDGET_S=${DITBENCH_BUDGET_S:-480}
export PYTHONUNBUFFERED=1 DITQ_CACHE_DIR=$RUN/cache
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
EXPORTS="KERNEL_SCHEMES TREE GEOMETRIES DITBENCH_ARGS DITBENCH_BUDGET_S PYTHONPATH"
COLLECT="run.log tests.log doctor.json tiny_sweep.tgz kernels.json kernels.log ditbench.json ditbench.log"

run_stages() {
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  for stage in $STAGES; do
    echo "== $stage at $(date -u +%T)"
    case "$stage" in
      tests)
        timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu -k "w4" tests/kernels 2>&1 | tail -40 >"$RUN/tests.log"
        tail -5 "$RUN/tests.log"
        ;;
      doctor)
        # correctness at every geometry: one configuration per kernel, no autotuning (DITQ_TRITON_AUTOTUNE=0)
        # shellcheck disable=SC2086
        DITQ_TRITON_AUTOTUNE=0 timeout 300 python3 -m ditq.cli doctor --scheme w4a8 w4a16 --device cuda --geometry $GEOMETRIES \
          --json "$RUN/doctor.json" --report "$RUN/doctor-reports" 2>&1 | tail -30
        ;;
      tiny)
        rm -rf "$RUN/tiny" "$RUN/tiny-sweep"
        python3 tools/full_size_pipeline.py --preset tiny --device cuda --out "$RUN/tiny" >/dev/null 2>&1
        DITQ_TRITON_AUTOTUNE=0 timeout "${TINY_S:-300}" python3 -m ditq.cli sweep "$RUN/tiny" --schemes w4a8,w4a16 \
          --fixtures "$RUN/tiny/fixtures/fixtures.json" --refs "$RUN/tiny/fixtures/refs" --out "$RUN/tiny-sweep" \
          --seeds 2301 --steps 2 --device cuda:0 --offload auto --max-memory 4GiB --no-progress >"$RUN/tiny_sweep.log" 2>&1
        echo "exit $?"
        tail -12 "$RUN/tiny_sweep.log"
        tar czf "$RUN/tiny_sweep.tgz" -C "$RUN" --exclude='*/artifact' --exclude='*/images' --exclude='*/grids' tiny-sweep
        ;;
      kernels)
        timeout 420 python3 benchmarks/kernels_bench.py --shapes four-bit --schemes "${KERNEL_SCHEMES:-fp8,w4a8,w4a16}" --no-torchao \
          --out "$RUN/kernels.json" >"$RUN/kernels.log" 2>&1
        tail -90 "$RUN/kernels.log"
        ;;
      ditbench)
        # shellcheck disable=SC2086
        timeout $((DITBENCH_BUDGET_S + 240)) python3 benchmarks/dit_bench.py --budget-s "$DITBENCH_BUDGET_S" \
          --loop-steps 9 $DITBENCH_ARGS --out "$RUN/ditbench.json" >"$RUN/ditbench.log" 2>&1
        tail -40 "$RUN/ditbench.log"
        ;;
    esac
  done
  echo "== finished at $(date -u +%T)"
  touch "$RUN/finished"
}

# shellcheck source=benchmarks/h200_detached.sh
source "$(dirname "$0")/h200_detached.sh"
detached_main "$@"
