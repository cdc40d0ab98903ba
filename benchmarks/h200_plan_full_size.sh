#!/usr/bin/env bash
# ditq plan at real size on an H200, detached so that it may outlast one shell command, from the repository root:
#   bash benchmarks/h200_plan_full_size.sh launch      # start the stages below in the background
#   bash benchmarks/h200_plan_full_size.sh wait [S]    # follow the log for up to S seconds, or until the run ends
#   bash benchmarks/h200_plan_full_size.sh collect     # copy results and logs to $OUT
# Stages (STAGES picks a subset, in this order):
#   tiny    benchmarks/plan_full_size.py on the tiny preset on the GPU (every step at a second's size)
#   full    benchmarks/plan_full_size.py on the full-size pipeline (built first, about 40 s), PLAN_ARGS appended
# The run lives in $RUN (default /tmp/plan-full); results go to $OUT (default ./h200-out).
set -o pipefail
OUT=${OUT:-h200-out}
RUN=${RUN:-/tmp/plan-full}
STAGES=${STAGES:-tiny full}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

run_stages() {
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  for stage in $STAGES; do
    echo "== $stage at $(date -u +%T)"
    case "$stage" in
      tiny)
        timeout "${TINY_S:-300}" python3 benchmarks/plan_full_size.py --pipeline "$RUN/tiny-pipeline" \
          --preset tiny --device cuda --steps 4 --out "$RUN/plan_full_size_tiny.json" >"$RUN/tiny.log" 2>&1
        echo "exit $?"
        tail -3 "$RUN/tiny.log"
        ;;
      full)
        # shellcheck disable=SC2086
        timeout "${FULL_S:-1500}" python3 benchmarks/plan_full_size.py --pipeline "$RUN/full-pipeline" \
          --device cuda --out "$RUN/plan_full_size.json" $PLAN_ARGS >"$RUN/full.log" 2>&1
        echo "exit $?"
        tail -3 "$RUN/full.log"
        ;;
      *) echo "unknown stage $stage" ;;
    esac
  done
  echo "== done at $(date -u +%T)"
  touch "$RUN/finished"
}

COLLECT="run.log tiny.log full.log plan_full_size_tiny.json plan_full_size.json plan_full_size.PLAN.json"
EXPORTS="PLAN_ARGS TINY_S FULL_S"
# shellcheck source=benchmarks/h200_detached.sh
source "$(dirname "$0")/h200_detached.sh"
detached_main "$@"
