#!/usr/bin/env bash
# Train and evaluate the bundled demo model on one H200, from the repository root, in three steps:
#   bash benchmarks/demo_train_h200.sh start      # launch training in the background (survives the calling shell)
#   bash benchmarks/demo_train_h200.sh wait [S]   # follow the log for up to S seconds, or until training ends
#   bash benchmarks/demo_train_h200.sh evaluate   # pick the guidance on a validation draw, score the held-out set
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
    for guidance in 2 3 4 5; do  # validation draw (task seed 7), not the held-out set
      # shellcheck disable=SC2086
      python3 -m ditq.demo.evaluate --model "$RUN/model" $EVAL_ARGS --task-seed 7 --guidance "$guidance" \
        --out "$RUN/validation_g$guidance.json" >/dev/null || exit 1
    done
    best=$(python3 -c "
import json
rows = {g: json.load(open(f'$RUN/validation_g{g}.json')) for g in (2, 3, 4, 5)}
keep = ('t2i_accuracy', 'edit_accuracy', 'by_layout', 'provenance')
json.dump({g: {k: rows[g][k] for k in keep} for g in rows}, open('$OUT/validation.json', 'w'), indent=2)
for g in rows:
    print(f'guidance {g}: t2i {rows[g][\"t2i_accuracy\"]} edits {rows[g][\"edit_accuracy\"]}', file=__import__('sys').stderr)
print(max(rows, key=lambda g: rows[g]['t2i_accuracy'] + rows[g]['edit_accuracy']))")
    echo "guidance chosen on validation: $best"
    # shellcheck disable=SC2086
    python3 -m ditq.demo.evaluate --model "$RUN/model" $EVAL_ARGS --guidance "$best" \
      --out "$OUT/demo_eval_h200.json" --grid "$OUT/demo_eval_all.png" | head -30
    tar cf "$OUT/model.tar" -C "$RUN" model
    ;;
  *)
    echo "usage: $0 start | wait [seconds] | evaluate" >&2
    exit 2
    ;;
esac
