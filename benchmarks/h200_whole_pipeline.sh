#!/usr/bin/env bash
# The whole Qwen-Image-2.1 pipeline under 24 GiB and 16 GiB on an H200 (or an H100: name the card with every result),
# every serving component quantized, detached so that it may outlast one shell command. From the repository root, with the machine's python3 (the wheels it lacks
# on PYTHONPATH):
#   bash benchmarks/h200_whole_pipeline.sh launch      # start the stages below in the background
#   bash benchmarks/h200_whole_pipeline.sh wait [S]    # follow the log for up to S seconds, or until the run ends
#   bash benchmarks/h200_whole_pipeline.sh collect     # copy results and logs to $OUT
# Stages (STAGES picks a subset, in this order; each has its own time limit):
#   tests    every GPU-marked test (pytest -m gpu, 4 workers); TESTS_WITH_SWEEP=1 runs them beside sweep24 instead,
#            once its first candidate starts quantizing (after the baseline, whose timings they would disturb), and
#            TESTS_BESIDE=STAGE beside that stage from its start (memory, say, which measures bytes, not seconds)
#   tiny     the chain on the GPU at the tiny preset: ditq sweep --schemes fp8 --offload auto --max-memory 4GiB
#   doctor   ditq doctor on every Linear geometry of the full-size transformer and text encoder
#   ditbench benchmarks/dit_bench.py: the full-size DiT's denoising loop, BF16 / ditq (fused and unfused) / torchao,
#            eager and compiled, in one process under a wall-clock budget (DITBENCH_BUDGET_S; DITBENCH_ARGS: more
#            options, --variants say)
#   build    the full-size pipeline with random weights (tools/full_size_pipeline.py)
#   sweep24  ditq sweep --schemes $SCHEMES --max-memory 24GiB --offload auto (quantize auto: transformer and text
#            encoder), 0-4 references at 1024x1024; sweep16, sweep12: the same under 16GiB, 12GiB (the issue's tables
#            in the sweep's form; SWEEP_ARGS: --calibrate gptq, say); the disk holds the model and two artifacts
#   sweepwhole ditq sweep --compile --offload none on the whole device, 0-4 references at 1024x1024, its BF16 baseline
#            compiled too: first with the first scheme of $SWEEP_WHOLE, then resumed with each further one added (each
#            invocation's SWEEP_S), its files packed after each, so that a run stopped early keeps a whole report;
#            SWEEP_ARGS: more options for every invocation (--accumulate fast, say)
#   attnbench benchmarks/attention_bench.py at the served shapes, 0-4 references: BF16 SDPA (flash, cuDNN) against
#            the paths of $ATTN_KINDS (default fp8-fp8: cuDNN's fp8 attention), eager and compiled
#   decodebench benchmarks/decode_answer_bench.py on the built model's VAE: the decode untouched, channels-last,
#            compiled and as --compile serves it, and the answer's parts before and after (TREE: the commit recorded)
#   tebench  benchmarks/text_encoder_bench.py: the text encoder's encode_prompt per fixture, BF16 and $TEBENCH_SCHEMES
#            (default fp8), eager and with its decoder layers compiled
#   sdpa     benchmarks/sdpa_first_call.py: the first call at a new attention shape, by SDPA backend
#   memory   benchmarks/pipeline_memory.py on the whole device: BF16 and the fp8 artifact (the sweep's, else
#            quantized here), stage by stage, and each
#            memory reduction against the untouched path
#   serve24  ditq serve --max-memory 24GiB --offload auto + ditq probe for each of $SERVE24 (schemes the sweep did
#            not run: their artifacts quantized here as the sweep quantizes, without its verify and doctor stages)
#   serve16  the same under 16GiB for each of $SERVE16 (bf16, fp8, fp8+kv-int8, w8a8, fp8+compile), with the 24 GiB
#            sweep's artifacts where it made them
#   serve12  the same under 12GiB for each of $SERVE12 (w4a8, say)
#   quantize quantize each of $QUANTIZE (components auto, on the GPU) unless the sweep did: before the stages that
#            time it, so that the GPU tests may run beside it (TESTS_BESIDE=build) and be joined (join) first;
#            SCHEME-gptq: GPTQ-rounded under --max-memory $CALIBRATE_BUDGET with --offload auto (artifact_for)
#   check    verify and the doctor of each $QUANTIZE artifact, beside each other as ditq sweep runs them (CHECK_S)
#   whole    the same on the whole device (no --max-memory, --offload none) for each of $WHOLE (default fp8): the
#            s/image the budgets are held against, from the same run; bf16+compile, fp8+compile: ditq serve --compile;
#            +fast: --accumulate fast; +attn-KIND: --attention KIND; +alloc-expandable: the server's allocator with
#            expandable segments (PYTORCH_CUDA_ALLOC_CONF); +again: the same server started a second time
#            (compiled code from the cache the first start filled: the warm start); +cache-KIND-VALUE: --cache
#            KIND:VALUE (diffusers' step cache: cache-first-block-0.4); +steps-N: N denoising steps instead of $STEPS
#   cachecompare  ditq compare of each whole entry with a +cache- option against the same entry without it (the
#            step cache's own deviation, PSNR and SSIM over the seeds; unsealed: the uncached run is no baseline)
#   democache the trained demo model on the GPU: ditq sweep --schemes $DEMO_SCHEMES --cache auto at each of
#            $DEMO_STEPS (the threshold the evidence picks under --standard lossless, on weights that make images)
#   clear    remove the artifacts the quantize stage made (ditbench writes its own; the disk holds two)
#   prune    remove the 24 GiB sweep's artifacts other than fp8's (the disk holds the model and two artifacts, barely)
# The run lives in $RUN (default /root/ditq-whole); results go to $OUT (default ./h200-out).
set -o pipefail
OUT=${OUT:-h200-out}
RUN=${RUN:-/root/ditq-whole}
STAGES=${STAGES:-tests tiny doctor build sweep24 serve24 serve16 memory whole}
SCHEMES=${SCHEMES:-fp8,w8a8}
SWEEP_WHOLE=${SWEEP_WHOLE:-fp8 w8a8}
SERVE24=${SERVE24:-}
SERVE16=${SERVE16:-fp8 bf16 fp8+kv-int8 w8a8}
SERVE12=${SERVE12:-w4a8}
WHOLE=${WHOLE:-fp8}
QUANTIZE=${QUANTIZE:-fp8}
VARIANTS=${VARIANTS:-base,cache-held,vae-tiling,kv-int8,keep-unused}  # the memory stage's
MEMORY_MODELS=${MEMORY_MODELS:-bf16 fp8}  # the memory stage's models: bf16 (the source) and schemes' artifacts
MEMORY_SEEDS=${MEMORY_SEEDS:-$SEEDS}
STEPS=${STEPS:-10}
DEMO_SCHEMES=${DEMO_SCHEMES:-fp8}
DEMO_STEPS=${DEMO_STEPS:-28 10}
DEMO_SEEDS=${DEMO_SEEDS:-2301-2304}
SEEDS=${SEEDS:-2301}
MODEL=$RUN/qwen-image-21-random
# Every Linear geometry ditq quantizes in the full-size pipeline (in x out): the transformer's three and the
# Qwen3-VL text encoder's (language model, vision tower with its 4304-wide MLP, deepstack mergers).
GEOMETRIES=${GEOMETRIES:-1152x1152 1152x3456 1152x4304 4304x1152 4096x1024 4096x4096 4096x12288 12288x4096 4608x4096 4608x4608}
NOTE="Weights are random (diffusers' and transformers' default initialisation), so every image is noise: PSNR and SSIM against BF16 measure numerical deviation, not image quality."
export PYTHONUNBUFFERED=1 CUDA_DEVICE_ORDER=PCI_BUS_ID DITQ_CACHE_DIR=$RUN/cache
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

run_stages() {
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  df -h "$RUN" | tail -1
  for stage in $STAGES; do
    echo "== $stage at $(date -u +%T)"
    [ "$stage" = "$TESTS_BESIDE" ] && { gpu_tests & }
    case "$stage" in
      tests)
        gpu_tests
        ;;
      tiny)
        rm -rf "$RUN/tiny" "$RUN/tiny-sweep"
        python3 tools/full_size_pipeline.py --preset tiny --device cuda --out "$RUN/tiny" >/dev/null 2>&1
        timeout "${TINY_S:-300}" python3 -m ditq.cli sweep "$RUN/tiny" --schemes fp8 --fixtures "$RUN/tiny/fixtures/fixtures.json" \
          --refs "$RUN/tiny/fixtures/refs" --out "$RUN/tiny-sweep" --seeds 2301 --steps 2 --device cuda:0 \
          --offload auto --max-memory 4GiB --no-progress >"$RUN/tiny_sweep.log" 2>&1
        echo "exit $?"
        tail -4 "$RUN/tiny_sweep.log"
        tar czf "$RUN/tiny_sweep.tgz" -C "$RUN" --exclude='*/artifact' --exclude='*/images' --exclude='*/grids' tiny-sweep
        ;;
      doctor)
        # shellcheck disable=SC2086
        timeout "${DOCTOR_S:-300}" python3 -m ditq.cli doctor --device cuda --geometry $GEOMETRIES \
          --json "$RUN/doctor_full_size.json" >"$RUN/doctor_full_size.log" 2>&1
        echo "exit $?"
        tail -20 "$RUN/doctor_full_size.log"
        ;;
      build)
        timeout 600 python3 tools/full_size_pipeline.py --preset full --device cuda --out "$MODEL" --force \
          >"$RUN/build.log" 2>&1
        echo "exit $?"
        tail -2 "$RUN/build.log"
        ;;
      sweep24|sweep16|sweep12)
        local budget=${stage#sweep}GiB name=sweep-${stage#sweep}gib
        if [ -n "$TESTS_WITH_SWEEP" ]; then  # the GPU tests beside the first candidate's quantize, verify and doctor
          (while ! grep -qE "${SCHEMES%%,*} +quantize +running" "$RUN/$name.log" 2>/dev/null; do sleep 5; done
           gpu_tests) &
        fi
        timeout "${SWEEP_S:-1200}" python3 -m ditq.cli sweep "$MODEL" --schemes "$SCHEMES" \
          --fixtures "$MODEL/fixtures/fixtures.json" --refs "$MODEL/fixtures/refs" --out "$RUN/$name" \
          --seeds "$SEEDS" --steps "$STEPS" --device cuda:0 --max-memory "$budget" --offload auto --health-timeout 900 \
          --no-progress --note "$NOTE" $SWEEP_ARGS >"$RUN/$name.log" 2>&1
        echo "exit $?"
        tail -6 "$RUN/$name.log"
        tar czf "$RUN/$name.tgz" -C "$RUN" --exclude="$name/*/artifact" --exclude='*/images' \
          --exclude="$name/report/grids" --exclude="$name/report/report.html" "$name" "$name.log"
        ;;
      sweepwhole)
        local schemes= free
        for scheme in $SWEEP_WHOLE; do
          # a scheme's artifact (the transformer and the text encoder) is 17 GB: a machine whose disk filled stopped
          # answering, and the run was lost with it
          free=$(df --output=avail -BG "$RUN" | tail -1 | tr -dc 0-9)
          # SCHEME-fast serves SCHEME's artifact when SCHEME is swept too: it needs no room of its own
          case ",$schemes," in *",${scheme%-fast},"*) [ "$scheme" != "${scheme%-fast}" ] && free=${SWEEP_FREE_GB:-24} ;; esac
          if [ -n "$schemes" ] && [ "$free" -lt "${SWEEP_FREE_GB:-24}" ]; then
            echo "sweep: $scheme not added, ${free} GB free on disk (SWEEP_FREE_GB=${SWEEP_FREE_GB:-24})"
            break
          fi
          schemes=${schemes:+$schemes,}$scheme
          timeout "${SWEEP_S:-1200}" python3 -m ditq.cli sweep "$MODEL" --schemes "$schemes" --compile \
            --fixtures "$MODEL/fixtures/fixtures.json" --refs "$MODEL/fixtures/refs" --out "$RUN/sweep-whole" \
            --seeds "$SEEDS" --steps "$STEPS" --device cuda:0 --offload none --health-timeout 900 --no-progress \
            --note "$NOTE" $SWEEP_ARGS >"$RUN/sweep-whole-$scheme.log" 2>&1
          echo "sweep $schemes: exit $?"
          tail -6 "$RUN/sweep-whole-$scheme.log"
          (cd "$RUN" && tar czf sweep-whole.tgz --exclude='sweep-whole/*/artifact' --exclude='*/images' \
            --exclude='sweep-whole/report/grids' --exclude='sweep-whole/report/report.html' sweep-whole sweep-whole-*.log)
        done
        ;;
      attnbench)
        # shellcheck disable=SC2086
        timeout "${ATTNBENCH_S:-300}" python3 benchmarks/attention_bench.py --kinds ${ATTN_KINDS:-fp8-fp8} \
          --out "$RUN/attention_bench.json" >"$RUN/attention_bench.log" 2>&1
        echo "exit $?"
        grep -v -i warn "$RUN/attention_bench.log" | tail -24
        ;;
      decodebench)
        timeout "${DECODEBENCH_S:-400}" python3 benchmarks/decode_answer_bench.py --model "$MODEL" --tree "${TREE:-}" \
          --out "$RUN/decode_answer_bench.json" >"$RUN/decode_answer_bench.log" 2>&1
        echo "exit $?"
        grep -v -i warn "$RUN/decode_answer_bench.log" | tail -8
        ;;
      tebench)
        timeout "${TEBENCH_S:-480}" python3 benchmarks/text_encoder_bench.py --model "$MODEL" \
          --schemes "bf16,${TEBENCH_SCHEMES:-fp8}" --repeats 3 --out "$RUN/text_encoder_bench.json" \
          >"$RUN/text_encoder_bench.log" 2>&1
        echo "exit $?"
        grep -v -i warn "$RUN/text_encoder_bench.log" | tail -20
        ;;
      sdpa)
        timeout "${SDPA_S:-120}" python3 benchmarks/sdpa_first_call.py --out "$RUN/sdpa_first_call.json" \
          >"$RUN/sdpa_first_call.log" 2>&1
        echo "exit $?"
        cat "$RUN/sdpa_first_call.log"
        ;;
      ditbench)
        # shellcheck disable=SC2086
        timeout "${DITBENCH_S:-600}" python3 benchmarks/dit_bench.py --out "$RUN/dit_bench.json" \
          --budget-s "${DITBENCH_BUDGET_S:-420}" --loop-steps 9 $DITBENCH_ARGS >"$RUN/dit_bench.log" 2>&1
        echo "exit $?"
        tail -40 "$RUN/dit_bench.log"
        ;;
      memory)
        models=()
        for m in $MEMORY_MODELS; do
          if [ "$m" = bf16 ]; then models+=(--model "$MODEL"); else models+=(--model "$(artifact_for "$m")"); fi
        done
        timeout "${MEMORY_S:-600}" python3 benchmarks/pipeline_memory.py "${models[@]}" \
          --fixtures "$MODEL/fixtures/fixtures.json" --refs "$MODEL/fixtures/refs" \
          --seeds "$MEMORY_SEEDS" --steps "$STEPS" --device cuda --variants "$VARIANTS" --variant-fixtures generate-0ref,edit-4ref \
          --out "$RUN/pipeline_memory.json" >"$RUN/pipeline_memory.log" 2>&1
        echo "exit $?"
        tail -3 "$RUN/pipeline_memory.log"
        ;;
      serve24)
        for entry in $SERVE24; do serve_probe "$entry" 24GiB; done
        ;;
      serve16)
        for entry in $SERVE16; do serve_probe "$entry" 16GiB; done
        ;;
      serve12)
        for entry in $SERVE12; do serve_probe "$entry" 12GiB; done
        ;;
      whole)
        for entry in $WHOLE; do serve_probe "$entry" whole; done
        ;;
      cachecompare)
        for entry in $WHOLE; do
          case "$entry" in *+cache-*) ;; *) continue ;; esac
          local uncached dir=$RUN/serve-whole/$entry
          uncached=$(echo "$entry" | sed -E 's/\+cache-[^+]*//')
          python3 -m ditq.cli compare --baseline "$RUN/serve-whole/$uncached/run" --allow-unsealed --no-lpips \
            --standard lossless "$dir/run" >"$dir/compare.log" 2>&1
          echo "$entry against $uncached: exit $?"
          tail -8 "$dir/compare.log"
        done
        tar czf "$RUN/serve-whole.tgz" -C "$RUN" --exclude='*/images' serve-whole
        ;;
      democache)
        for steps in $DEMO_STEPS; do
          rm -rf "$RUN/demo-cache-$steps"
          timeout "${DEMO_S:-600}" python3 -m ditq.cli sweep ditq/demo/model --schemes "$DEMO_SCHEMES" --cache auto \
            --fixtures ditq/demo/fixtures.json --refs ditq/demo/references --out "$RUN/demo-cache-$steps" \
            --seeds "$DEMO_SEEDS" --steps "$steps" --device cuda:0 --offload none --no-progress \
            >"$RUN/demo-cache-$steps.log" 2>&1
          echo "demo at $steps steps: exit $?"
          tail -6 "$RUN/demo-cache-$steps.log"
          tar czf "$RUN/demo-cache-$steps.tgz" -C "$RUN" --exclude='*/artifact' --exclude='*/images' \
            --exclude='*/grids' --exclude='*/report.html' "demo-cache-$steps" "demo-cache-$steps.log"
        done
        ;;
      quantize)
        for scheme in $QUANTIZE; do echo "$scheme: $(artifact_for "$scheme")"; done
        ;;
      check)
        # verify (against the source) and the doctor (its artifact's shapes, autotuning as a server does) of each
        # $QUANTIZE artifact, beside each other as ditq sweep runs them; each log ends with its exit status and time
        for scheme in $QUANTIZE; do
          local art began
          art=$(artifact_for "$scheme")
          began=$SECONDS  # after the quantize artifact_for runs where no earlier stage made the artifact
          (timeout "${CHECK_S:-300}" python3 -m ditq.cli verify "$art" --source "$MODEL" >"$RUN/verify-$scheme.log" 2>&1
           echo "verify $scheme: exit $? in $((SECONDS - began)) s" | tee -a "$RUN/verify-$scheme.log") &
          timeout "${CHECK_S:-300}" python3 -m ditq.cli doctor --artifact "$art" --scheme "${scheme%-gptq}" --device cuda:0 \
            --dtype bfloat16 --json "$RUN/doctor-$scheme.json" >"$RUN/doctor-$scheme.log" 2>&1
          echo "doctor $scheme: exit $? in $((SECONDS - began)) s" | tee -a "$RUN/doctor-$scheme.log"
          wait
        done
        ;;
      clear)
        rm -rf "$RUN/artifacts" && echo "removed $RUN/artifacts"  # room for ditbench's own artifacts
        df -h "$RUN" | tail -1
        ;;
      prune)
        for dir in "$RUN"/sweep-24gib/*/artifact; do
          case "$dir" in */fp8/artifact) ;; *) rm -rf "$dir" && echo "removed $dir" ;; esac
        done
        df -h "$RUN" | tail -1
        ;;
      join)
        wait  # the GPU tests started beside an earlier stage, before anything here is timed
        ;;
      *) echo "unknown stage $stage" ;;
    esac
  done
  wait  # the GPU tests, where they ran beside a stage
  echo "== done at $(date -u +%T)"
  touch "$RUN/finished"
}

# artifact_for SCHEME: a sweep's artifact of SCHEME (24, 16 or 12 GiB), else one quantized here as the sweep
# quantizes (components auto, on the GPU). SCHEME-gptq: GPTQ-rounded on the model's fixtures as the sweep's -gptq
# candidate is, its source placed with --offload auto under --max-memory $CALIBRATE_BUDGET (default 16GiB);
# CALIBRATE_ARGS: more quantize options (--calibration-seeds 2301 --calibration-steps 2, say). The log ends with the
# command's exit status and seconds.
artifact_for() {
  local scheme=$1 sweep flags=(--scheme "${1%-gptq}") began=$SECONDS
  for sweep in sweep-24gib sweep-16gib sweep-12gib; do
    if [ -f "$RUN/$sweep/$scheme/artifact/MANIFEST.json" ]; then
      echo "$RUN/$sweep/$scheme/artifact"
      return
    fi
  done
  case "$scheme" in
    # shellcheck disable=SC2206
    *-gptq) flags+=(--calibrate gptq --fixtures "$MODEL/fixtures/fixtures.json" --refs "$MODEL/fixtures/refs"
                    --offload auto --max-memory "${CALIBRATE_BUDGET:-16GiB}" $CALIBRATE_ARGS) ;;
  esac
  if [ ! -f "$RUN/artifacts/$scheme/MANIFEST.json" ]; then
    # each line stamped with the time it was written (a calibration's passes and rounding, timed); appended, so that
    # a later stage asking again after a failure keeps the first attempt's log (run 8 lost one so)
    echo "== ditq quantize $scheme at $(date -u +%T)" >>"$RUN/quantize-$scheme.log"
    python3 -m ditq.cli quantize "$MODEL" "$RUN/artifacts/$scheme" "${flags[@]}" --device cuda:0 --force 2>&1 |
      while IFS= read -r line; do printf '%s %s\n' "$(date -u +%T)" "$line"; done >>"$RUN/quantize-$scheme.log"
    echo "quantize $scheme: exit ${PIPESTATUS[0]} in $((SECONDS - began)) s" >>"$RUN/quantize-$scheme.log"
  fi
  echo "$RUN/artifacts/$scheme"
}

# Every GPU-marked test, 4 workers, of $GPU_TESTS (default: every test file; tests/serve/test_serve_openai_client.py
# and tests/serve/test_serve_request_fields.py import the openai client, which the machine lacks; they hold no GPU
# test).
gpu_tests() {
  # shellcheck disable=SC2086
  timeout "${TESTS_S:-480}" python3 -m pytest -q -p no:cacheprovider -m gpu -n 4 ${GPU_TESTS_ARGS:-} ${GPU_TESTS:-tests} \
    --ignore tests/serve/test_serve_openai_client.py --ignore tests/serve/test_serve_request_fields.py \
    >"$RUN/gpu_tests.log" 2>&1
  echo "gpu tests: exit $?; $(tail -1 "$RUN/gpu_tests.log")"
}

# serve_probe ENTRY BUDGET: ENTRY is bf16 (the source) or SCHEME (the 24 GiB sweep's artifact), each with any of
# +kv-int8 (--kv-cache int8) and +compile (--compile); what a user runs by hand: ditq serve under the budget with
# --offload auto, then ditq probe against it.
serve_probe() {
  local entry=$1 budget=$2 scheme=${1%%+*} extra=() model dir port=8941 option logs= steps=$STEPS alloc=
  for option in $(echo "${entry#"$scheme"}" | tr '+' ' '); do
    case "$option" in
      kv-*) extra+=(--kv-cache "${option#kv-}") ;;
      compile) extra+=(--compile); logs=recompiles ;;
      fast) extra+=(--accumulate fast) ;;
      attn-*) extra+=(--attention "${option#attn-}") ;;
      # cache-KIND-VALUE: --cache KIND:VALUE (cache-first-block-0.4, cache-taylorseer-2); the step cache is eager only
      cache-*) option=${option#cache-} && extra+=(--cache "${option%-*}:${option##*-}") ;;
      steps-*) steps=${option#steps-} ;;  # this entry's num_inference_steps instead of $STEPS
      again) ;;  # the same server again: dir and options as given, the compile cache as the first start left it
      # alloc-expandable: the server's CUDA caching allocator with expandable segments (PYTORCH_CUDA_ALLOC_CONF), the
      # allocator's own answer to memory reserved but unallocated (fragmentation) under a --max-memory budget
      alloc-expandable) alloc=expandable_segments:True ;;
      *) echo "unknown option $option in $entry"; return ;;
    esac
  done
  model=$MODEL
  [ "$scheme" != bf16 ] && model=$(artifact_for "$scheme")
  dir=$RUN/serve-${budget,,}/$entry
  rm -rf "$dir" && mkdir -p "$dir"
  local placing=(--max-memory "$budget" --offload auto)
  [ "$budget" = whole ] && placing=(--offload none)
  # (an empty TORCH_LOGS stops `import torch`: set only where there is something to log)
  env ${logs:+TORCH_LOGS=$logs} ${alloc:+PYTORCH_CUDA_ALLOC_CONF=$alloc} python3 -m ditq.cli serve "$model" --device cuda:0 "${placing[@]}" --port $port \
    --on-collapse warn "${extra[@]}" >"$dir/serve.log" 2>&1 &
  local pid=$!
  local waited=0  # until /health answers 200, the server exits (a failed start) or 600 s pass
  until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
    kill -0 $pid 2>/dev/null && [ $waited -lt 600 ] || break
    sleep 2 && waited=$((waited + 2))
  done
  if curl -sf "http://127.0.0.1:$port/health" >/dev/null; then
    curl -s "http://127.0.0.1:$port/health" >"$dir/health.json"
    timeout "${PROBE_S:-400}" python3 -m ditq.cli probe --endpoint "http://127.0.0.1:$port" \
      --fixtures "$MODEL/fixtures/fixtures.json" --refs "$MODEL/fixtures/refs" --out "$dir/run" --seeds "$SEEDS" \
      --steps "$steps" --server-pid $pid --no-progress >"$dir/probe.log" 2>&1
    echo "$entry at $budget: probe exit $?"
    curl -s "http://127.0.0.1:$port/health" >"$dir/health_after.json"  # graphs compiled while serving, say
  else
    echo "$entry at $budget: the server never became healthy"
  fi
  kill $pid 2>/dev/null
  wait $pid 2>/dev/null
  tail -2 "$dir/serve.log"
  # after every entry, so that a run stopped early still hands back what it served
  tar czf "$RUN/serve-${budget,,}.tgz" -C "$RUN" --exclude='*/images' "serve-${budget,,}"
}

COLLECT="run.log gpu_tests.log quantize-w4a8-gptq.log verify-w4a8-gptq.log doctor-w4a8-gptq.log doctor-w4a8-gptq.json demo-cache-28.tgz demo-cache-10.tgz decode_answer_bench.json decode_answer_bench.log attention_bench.json sdpa_first_call.json text_encoder_bench.json text_encoder_bench.log sweep-whole.tgz sweep-16gib.tgz sweep-12gib.tgz dit_bench.json doctor_full_size.json tiny_sweep.tgz sweep-24gib.tgz serve-24gib.tgz pipeline_memory.json serve-16gib.tgz serve-12gib.tgz serve-whole.tgz"
EXPORTS="CHECK_S TREE CALIBRATE_BUDGET CALIBRATE_ARGS DEMO_SCHEMES DEMO_STEPS DEMO_SEEDS DEMO_S SWEEP_ARGS DECODEBENCH_S ATTN_KINDS ATTNBENCH_S GPU_TESTS_ARGS SWEEP_WHOLE SWEEP_FREE_GB SDPA_S GPU_TESTS DITBENCH_ARGS TESTS_WITH_SWEEP TESTS_BESIDE SCHEMES SERVE24 SERVE16 SERVE12 WHOLE QUANTIZE VARIANTS MEMORY_MODELS MEMORY_SEEDS DITBENCH_S DITBENCH_BUDGET_S STEPS SEEDS MODEL GEOMETRIES NOTE TESTS_S TINY_S DOCTOR_S SWEEP_S MEMORY_S PROBE_S"
export -f serve_probe gpu_tests artifact_for
# shellcheck source=benchmarks/h200_detached.sh
source "$(dirname "$0")/h200_detached.sh"
detached_main "$@"
