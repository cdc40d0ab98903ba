#!/usr/bin/env bash
# The H200 run for the kernel paths: doctor over every CUDA path, GPU tests, GEMM benchmark.
# Writes under $OUT (default ./h200-out). Runs from the repository root with the machine's python3.
set -o pipefail
OUT=${OUT:-h200-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv 2>&1 | tee "$OUT/log"
# 1. The doctor, correctness only (one Triton config per kernel, no tuning).
DITQ_TRITON_AUTOTUNE=0 DITQ_CACHE_DIR=/tmp/ditq-cache timeout "${DOCTOR_S:-120}" \
  python3 -m ditq.cli doctor --synthetic --json "$OUT/doctor_h200.json" --report /tmp/doctor_reports 2>&1 \
  | tee "$OUT/doctor.log" | grep -v "^INFO"
[ -d /tmp/doctor_reports ] && tar czf "$OUT/doctor_reports.tgz" -C /tmp doctor_reports
# 2. GPU tests not covered by the doctor (torch.compile tracing, activation quantization) and the persistent paths.
DITQ_TRITON_AUTOTUNE=0 timeout "${TESTS_S:-60}" python3 -m pytest -q --noconftest -p no:cacheprovider -m gpu \
  tests/kernels -k "${TESTS_K:-compile or activation or persistent}" 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
# 3. GEMM throughput (autotuned).
TRITON_PRINT_AUTOTUNING=1 timeout "${BENCH_S:-110}" python3 benchmarks/kernels_bench.py ${BENCH_ARGS:---no-torchao} \
  --out "$OUT/kernels_bench.json" 2>&1 | tee "$OUT/bench.log" | grep -v "^Triton autotuning\|^best config"
