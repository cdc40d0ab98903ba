#!/usr/bin/env bash
# The detached H200 runs' shared verbs, sourced by benchmarks/demo_train_h200.sh, h200_kernels_loop.sh,
# h200_plan_full_size.sh and h200_whole_pipeline.sh once
# they define run_stages (which ends by touching "$RUN/finished"), RUN, OUT, COLLECT (the files to copy) and
# EXPORTS (the variables run_stages reads):
#   launch      start run_stages in the background, in its own process session, so it outlasts the shell
#   resume      the same over the run folder as it is (what earlier stages made stays), its log run-resumed.log
#   wait [S]    follow the log for up to S seconds (default 540), or until the run ends; at once, status 3,
#               where $RUN is not there (a machine that went back idle took the run with it)
#   collect     copy the COLLECT files of $RUN to $OUT
#   snapshot    pack what the run has written so far, its small text files only (logs, JSON; no model, artifact
#               or image), into $OUT/snapshot.tgz: a machine lost mid-run then leaves its logs with the last call
detached_main() {
  case "$1" in
    launch)
      rm -rf "$RUN" && mkdir -p "$RUN"
      export -f run_stages
      # shellcheck disable=SC2086
      export RUN STAGES $EXPORTS
      setsid nohup bash -c run_stages >"$RUN/run.log" 2>&1 </dev/null &
      echo "launched: $STAGES"
      ;;
    resume)
      export -f run_stages
      # shellcheck disable=SC2086
      export RUN STAGES $EXPORTS
      rm -f "$RUN/finished"
      setsid nohup bash -c run_stages >"$RUN/run-resumed.log" 2>&1 </dev/null &
      echo "resumed: $STAGES"
      ;;
    wait)
      if [ ! -d "$RUN" ]; then  # a fresh machine (the one that ran it went back idle): nothing to wait for
        echo "no run at $RUN: nothing to wait for" >&2
        return 3
      fi
      local deadline=$((SECONDS + ${2:-540}))
      while [ ! -f "$RUN/finished" ] && [ $SECONDS -lt $deadline ]; do sleep 5; done
      cat "$RUN/run.log" "$RUN/run-resumed.log" 2>/dev/null
      # where a stage is still running: the last lines of the log written last
      local newest
      newest=$(find "$RUN" -type f -name '*.log' -printf '%T@ %p\n' | sort -n | tail -1 | cut -d' ' -f2-)
      [ ! -f "$RUN/finished" ] && [ -n "$newest" ] && { echo "-- ${newest#"$RUN"/}:"; tail -5 "$newest" | cut -c1-300; }
      ;;
    snapshot)
      if [ ! -d "$RUN" ]; then
        echo "no run at $RUN: nothing to pack" >&2
        return 3
      fi
      mkdir -p "$OUT"
      (cd "$RUN" && find . -type f -size -4M \( -name '*.log' -o -name '*.json' -o -name '*.jsonl' -o -name '*.txt' \) \
        -print0 | tar czf "$OUT/snapshot.tgz" --null -T -)
      ls -la "$OUT/snapshot.tgz"
      ;;
    collect)
      mkdir -p "$OUT"
      for f in $COLLECT; do
        [ -f "$RUN/$f" ] && cp "$RUN/$f" "$OUT/"
      done
      ls -la "$OUT"
      ;;
    *)
      echo "usage: $0 launch | resume | wait [seconds] | collect | snapshot" >&2
      exit 2
      ;;
  esac
}
