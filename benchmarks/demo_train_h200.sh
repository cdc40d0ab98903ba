#!/usr/bin/env bash
# Train and evaluate the bundled demo model on one H200, detached so that it may outlast one shell command, from the
# repository root:
#   bash benchmarks/demo_train_h200.sh launch      # start the stages below in the background
#   bash benchmarks/demo_train_h200.sh wait [S]    # follow the log for up to S seconds, or until the run ends
#   bash benchmarks/demo_train_h200.sh collect     # copy the summary, the log, the evaluation and the model to $OUT
# Stages (STAGES picks a subset, in this order):
#   train     python -m ditq.demo.train --out $RUN $TRAIN_ARGS (one command, one schedule)
#   evaluate  score the held-out set (default guidance) and pack the model
# The run lives in $RUN (default /tmp/demo-run); results go to $OUT (default ./demo-train-out).
set -o pipefail
OUT=${OUT:-demo-train-out}
RUN=${RUN:-/tmp/demo-run}
STAGES=${STAGES:-train evaluate}
TRAIN_ARGS=${TRAIN_ARGS:---time-budget 720 --batch-size 512 --lr 8e-4 --workers 12 --compile --eval-every 180}
EVAL_ARGS=${EVAL_ARGS:---device cuda}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

run_stages() {
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1
  for stage in $STAGES; do
    echo "== $stage at $(date -u +%T)"
    case "$stage" in
      train)
        # shellcheck disable=SC2086
        python3 -m ditq.demo.train --out "$RUN" $TRAIN_ARGS >"$RUN/train.log" 2>&1
        echo "exit $?"
        grep -v '^\s*$' "$RUN/train.log" | grep -v "Warning\|warn(" | tail -20
        ;;
      evaluate)
        # shellcheck disable=SC2086
        python3 -m ditq.demo.evaluate --model "$RUN/model" $EVAL_ARGS --out "$RUN/demo_eval_h200.json" \
          --grid "$RUN/demo_eval_all.png" >"$RUN/evaluate.log" 2>&1
        echo "exit $?"
        head -30 "$RUN/evaluate.log"
        tar cf "$RUN/model.tar" -C "$RUN" model
        ;;
      *) echo "unknown stage $stage" ;;
    esac
  done
  echo "== done at $(date -u +%T)"
  touch "$RUN/finished"
}

COLLECT="run.log train.log evaluate.log train_summary.json train_log.jsonl demo_eval_h200.json demo_eval_all.png model.tar"
EXPORTS="TRAIN_ARGS EVAL_ARGS"
# shellcheck source=benchmarks/h200_detached.sh
source "$(dirname "$0")/h200_detached.sh"
detached_main "$@"
