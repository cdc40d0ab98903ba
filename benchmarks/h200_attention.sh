#!/usr/bin/env bash
# Quantized attention on the H200, in one call from the repository root (about 5 minutes):
#   OUT=DIR bash benchmarks/h200_attention.sh
# Stages (STAGES picks a subset, in this order; each has its own time limit):
#   tests   the attention GPU tests (tests/kernels/test_attention_gpu.py and the numerics' CUDA cases; one Triton
#           configuration, no tuning)
#   compile the compiled pipeline through the Triton attention kernels (tests/runtime/test_runtime_gpu.py; not by
#           default)
#   diffusers  the diffusers quantizer's CUDA test (tests/runtime/test_diffusers_quantizer.py; not by default)
#   doctor  ditq doctor --attention for every kind on cuda (JSON)
#   tune    benchmarks/attention_tune.py: the int8-fp8 kernel's launch configurations at the served shapes
#   ncu     Nsight Compute over attention_tune.py --once: pipes, occupancy, stalls per variant (not by default)
#   bench   benchmarks/attention_bench.py (BENCH_ARGS: default --refs 0 4 --prefill): the step's and the
#           prefill's attention at 1024x1024, BF16 SDPA (flash, cuDNN) against each kind's paths
# Results and logs go to $OUT (default ./h200-out).
set -o pipefail
OUT=${OUT:-h200-out}
STAGES=${STAGES:-tests doctor tune bench}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
for stage in $STAGES; do
  echo "== $stage at $(date -u +%T)"
  case "$stage" in
    tests)
      DITQ_TRITON_AUTOTUNE=0 timeout "${TESTS_S:-240}" python3 -m pytest -q --noconftest -p no:cacheprovider -m gpu \
        tests/kernels/test_attention_gpu.py tests/kernels/test_attention_numerics.py >"$OUT/attention_gpu_tests.log" 2>&1
      tail -4 "$OUT/attention_gpu_tests.log"
      ;;
    compile)
      # serve --compile --attention int8|int8-fp8 on the demo model: inductor's pixels against eager's
      timeout "${COMPILE_S:-300}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/runtime/test_runtime_gpu.py \
        -k triton_attention >"$OUT/compile_attention_tests.log" 2>&1
      tail -4 "$OUT/compile_attention_tests.log"
      ;;
    diffusers)
      timeout "${DIFFUSERS_S:-240}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/runtime/test_diffusers_quantizer.py \
        >"$OUT/diffusers_gpu_tests.log" 2>&1
      tail -4 "$OUT/diffusers_gpu_tests.log"
      ;;
    doctor)
      timeout "${DOCTOR_S:-120}" python3 -m ditq.cli doctor --device cuda --attention int8 fp8 int8-fp8 \
        --kernels cpu-reference-w8a8 --json "$OUT/doctor_attention.json" >"$OUT/doctor_attention.log" 2>&1
      echo "doctor: exit $?"; grep -E "attention" "$OUT/doctor_attention.log" | tail -8
      ;;
    tune)
      timeout "${TUNE_S:-300}" python3 benchmarks/attention_tune.py --out "$OUT/attention_tune.json" \
        >"$OUT/attention_tune.log" 2>&1
      echo "tune: exit $?"; grep -v "done at" "$OUT/attention_tune.log" | cut -c1-160 | tail -34
      ;;
    ncu)
      # the profiler's pipe utilisation, occupancy and stalls for the BLOCK_M=64 variants at 4 references (it needs
      # the GPU's hardware counters; where they cannot be read, ncu says so in its log)
      timeout "${NCU_S:-240}" ncu --clock-control none -k regex:_attention_pv8 --section ComputeWorkloadAnalysis \
        --section SpeedOfLight --section Occupancy --section WarpStateStats \
        python3 benchmarks/attention_tune.py --once --out /dev/null >"$OUT/attention_ncu.log" 2>&1
      echo "ncu: exit $?"; grep -E "launched|Duration|highest-utilized|Issue Slots|Achieved Occupancy|Warp Cycles Per Issued|Error" \
        "$OUT/attention_ncu.log" | head -60
      ;;
    bench)
      # shellcheck disable=SC2086
      timeout "${BENCH_S:-300}" python3 benchmarks/attention_bench.py ${BENCH_ARGS:---refs 0 4 --prefill} \
        --out "$OUT/attention_bench.json" >"$OUT/attention_bench.log" 2>&1
      echo "bench: exit $?"; tail -16 "$OUT/attention_bench.log"
      ;;
    *) echo "unknown stage $stage" ;;
  esac
done
echo "== done at $(date -u +%T)"
