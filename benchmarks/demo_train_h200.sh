#!/usr/bin/env bash
# Train and evaluate the bundled demo model on one H200, from the repository root, in three steps:
#   bash benchmarks/demo_train_h200.sh start      # launch training in the background (survives the calling shell)
#   bash benchmarks/demo_train_h200.sh wait [S]   # follow the log for up to S seconds, or until training ends
#   bash benchmarks/demo_train_h200.sh evaluate   # score the held-out set (default guidance), pack the model
# Training runs detached because it is longer than one shell session may last; it is one command, one schedule.
# Results go to $OUT (default ./demo-train-out); the run itself lives in $RUN (default /tmp/demo-run).
set -o pipefail
OUT=${OUT:-demo-train-out}
RUN=${RUN:-/tmp/demo-run}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
TRAIN_ARGS=${TRAIN_ARGS:---time-budget 720 --batch-size 512 --lr 8e-4 --workers 12 --compile --eval-every 180}
EVAL_ARGS=${EVAL_ARGS:---device cuda}

case "$1" in
  start)
    mkdir -p "$RUN"
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    # shellcheck disable=SC2086
    setsid nohup python3 -m ditq.demo.train --out "$RUN" $TRAIN_ARGS >"$RUN/stdout.log" 2>&1 </dev/null &
    echo "started training: python -m ditq.demo.train --out $RUN $TRAIN_ARGS"
    ;;
  wait)
    deadline=$((SECONDS + ${2:-540}))
    while [ ! -f "$RUN/train_summary.json" ] && [ $SECONDS -lt $deadline ]; do
      if ! pgrep -f "ditq.demo.train" >/dev/null; then echo "training is not running"; break; fi
      sleep 10
    done
    grep -v '^\s*$' "$RUN/stdout.log" | grep -v "Warning\|warn(" | tail -40
    ;;
  evaluate)
    cp "$RUN/train_summary.json" "$RUN/train_log.jsonl" "$OUT/" || exit 1
    # shellcheck disable=SC2086
    python3 -m ditq.demo.evaluate --model "$RUN/model" $EVAL_ARGS --out "$OUT/demo_eval_h200.json" \
      --grid "$OUT/demo_eval_all.png" | head -30
    tar cf "$OUT/model.tar" -C "$RUN" model
    ;;
  *)
    echo "usage: $0 start | wait [seconds] | evaluate" >&2
    exit 2
    ;;
esac
