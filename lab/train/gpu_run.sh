#!/usr/bin/env bash
# The training study on one GPU machine, in the background, across device calls (a call lasts at
# most 10 minutes; the machine is held while calls follow one another).  docs/training.md gives the
# commands, budgets and device time.
#
#   there: bash lab/train/gpu_run.sh start    copies this tree to $STORE/repo and runs every phase
#                                             there (setsid); returns at once
#   there: bash lab/train/gpu_run.sh wait [S] waits up to S seconds (default 540) or until the run
#                                             ends; prints the phase log and each log's tail; packs the
#                                             results into $OUT/train_results.tgz and, once the run
#                                             is done, the six state files: 7 of the 8 files a call
#                                             brings back, so a call that waits writes one other at most
# Phases: build (the mala extension, in the background from the start), corpus (scan, tokenizer if
# lab/train/tokenizer.json is absent, token streams), pt (4K pre-training: both arms of every size in
# SIZES at once, PT_BUDGET_S each), lct (16K, LCT_BUDGET_S), timing, regime, grads, speed, matched.
# Timing, speed and the saved states use a size's first seed.
# Environment: STORE (default /tmp/mala-train), SIZES (default "s4m m13m"), SEEDS (default 42), ARMS
# (default "dense mala"; "mala0" is MALA's kernels at tau = 0, the control arm, and "dense_ea" SDPA's
# memory-efficient kernel, the noise floor: they train, and their analysis is their held-out evals;
# timing, regime and speed run for dense and mala only), PT_BUDGET_S (330),
# LCT_BUDGET_S (120), LCT_SIZES (default: SIZES); PT_STEPS / LCT_STEPS fix the step counts instead of the
# budgets (both arms then train on the same tokens without agreeing); COMPILE_LOSS=1 runs the loss
# through torch.compile in training and timing (train.py --compile-loss); COMPILE_LOSS=auto first times
# both losses on the first size's random init (analyze.py timing --random-init, into
# $RES/loss_timing.json) and compiles where that is at least 5% faster.  FA4_SITE: a pip --target
# folder that lab/scripts/wheels.sh install fa4 fills during the run (its wheels come in parts over
# several calls); the speed phase waits up to FA4_WAIT_S (300) for its .ready-fa4, then times
# FlashAttention-4 beside the others (speed.json records it unavailable otherwise).  SERIAL=1 trains
# the runs of a stage one after another instead of at once: the GPU time-slices between processes, so
# a few small runs at once finish later than the same runs in turn (docs/training.md, "Commands");
# use it with fixed PT_STEPS / LCT_STEPS (budgets are then per run, with no step count to agree on).
# SKIP: phases left out, from "timing regime grads speed matched" (for example more seeds of a size
# whose step time and speed a run has already measured).  GRAD_PROBE_EVERY=N: the pre-training runs
# probe each attention's gradient against fp32 attention every N steps (train.py --grad-probe-every,
# 2 batches of 4 x 4K held-out sequences).
set -euo pipefail
cd "$(dirname "$0")/../.."
STORE=${STORE:-/tmp/mala-train}
SIZES=${SIZES:-"s4m m13m"}
SEEDS=${SEEDS:-42}
ARMS=${ARMS:-"dense mala"}
LCT_SIZES=${LCT_SIZES:-$SIZES}
PT_BUDGET_S=${PT_BUDGET_S:-330}
LCT_BUDGET_S=${LCT_BUDGET_S:-120}
PT_STEPS=${PT_STEPS:-0}
LCT_STEPS=${LCT_STEPS:-0}
COMPILE_LOSS=${COMPILE_LOSS:-0}
FA4_SITE=${FA4_SITE:-}
FA4_WAIT_S=${FA4_WAIT_S:-300}
SERIAL=${SERIAL:-0}
SKIP=${SKIP:-}
GRAD_PROBE_EVERY=${GRAD_PROBE_EVERY:-0}
RES=$STORE/res

# Per-size overrides: SEEDS_<size>, ARMS_<size>, PT_STEPS_<size>, LCT_STEPS_<size> (for example a
# control arm of one size beside both arms of another, in one run).
for_size() { local v="${1}_$2"; echo "${!v:-${!1}}"; }
skip() { [[ " $SKIP " == *" $1 "* ]]; }
arms_analyzed() { for a in $(for_size ARMS "$1"); do case $a in dense|mala) echo "$a" ;; esac; done; }

phases() {
  local R=$STORE/repo T=$STORE/repo/lab/train D=$STORE/data W=$STORE/work
  export PYTHONPATH=$STORE/site${FA4_SITE:+:$FA4_SITE}${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
  mkdir -p "$D" "$W" "$RES" "$STORE/sync"
  cd "$R"
  ph() { echo "$(date +%T) $*" >> "$RES/phases.log"; }
  ph "start SERIAL=$SERIAL GRAD_PROBE_EVERY=$GRAD_PROBE_EVERY SIZES=$SIZES SEEDS=$SEEDS ARMS=$ARMS PT_BUDGET_S=$PT_BUDGET_S LCT_BUDGET_S=$LCT_BUDGET_S PT_STEPS=$PT_STEPS LCT_STEPS=$LCT_STEPS COMPILE_LOSS=$COMPILE_LOSS" \
     "$(env | grep -E '^(SEEDS|ARMS|PT_STEPS|LCT_STEPS)_' | sort | tr '\n' ' ')"
  rm -rf "$STORE/site" "$STORE/build.done" "$STORE/build.failed"
  ( CMAKE_ARGS=-DCMAKE_CUDA_ARCHITECTURES=90a CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install \
      --no-build-isolation --no-deps --no-cache-dir --upgrade --target "$STORE/site" . > "$RES/build.log" 2>&1 \
      && touch "$STORE/build.done" || touch "$STORE/build.failed" ) &
  ph "corpus scan"
  python3 "$T/code_corpus.py" scan --out "$D" > "$RES/corpus.log" 2>&1
  TOK=$T/tokenizer.json
  if [ ! -f "$TOK" ]; then
    ph "tokenizer train"
    python3 "$T/tokenizer.py" --data "$D" --out "$RES/tokenizer.json" >> "$RES/corpus.log" 2>&1
    TOK=$RES/tokenizer.json
  fi
  ph "corpus build"
  python3 "$T/code_corpus.py" build --data "$D" --tokenizer "$TOK" >> "$RES/corpus.log" 2>&1
  cp "$D/manifest.tsv.gz" "$D/manifest.json" "$D/streams.json" "$RES/"
  while [ ! -f "$STORE/build.done" ]; do
    [ -f "$STORE/build.failed" ] && { ph "build failed"; exit 1; }
    sleep 2
  done
  ph "build done"
  if [ "$COMPILE_LOSS" = auto ]; then
    s0=${SIZES%% *}
    for c in "" --compile-loss; do
      python3 "$T/analyze.py" timing --size "$s0" --arm dense --stage pt --seqlen 4096 --random-init --data random \
        --work "$W" --out "$RES/loss_timing" --steps 5 $c >> "$RES/loss_timing.log" 2>&1 || ph "loss timing '$c' failed"
    done
    COMPILE_LOSS=$(python3 - "$RES/loss_timing/timing.json" <<'PYEOF'
import json, sys
try:
    t = json.load(open(sys.argv[1]))
    eager = next(v["step_ms"] for k, v in t.items() if not v.get("compile_loss"))
    comp = next(v["step_ms"] for k, v in t.items() if v.get("compile_loss"))
    print(1 if comp <= 0.95 * eager else 0)
except Exception:
    print(0)
PYEOF
)
    cp "$RES/loss_timing/timing.json" "$RES/loss_timing.json" 2>/dev/null || true
    ph "COMPILE_LOSS=$COMPILE_LOSS (from loss_timing.json)"
  fi
  common=(--data "$D" --tokenizer "$TOK" --out "$RES" --work "$W")
  cl=()
  [ "$COMPILE_LOSS" = 1 ] && cl=(--compile-loss)
  # Runs in turn take no time from one another: no step count for the arms to agree on.
  sync=(--sync "$STORE/sync")
  if [ "$SERIAL" = 1 ]; then sync=(); fi
  ph "pt"
  pids=()
  for s in $SIZES; do
    for seed in $(for_size SEEDS "$s"); do
      for arm in $(for_size ARMS "$s"); do
        python3 "$T/train.py" --size "$s" --arm "$arm" --seed "$seed" --stage pt --seqlen 4096 --budget-s "$PT_BUDGET_S" \
          --steps "$(for_size PT_STEPS "$s")" \
          "${sync[@]}" --eval-every 100 --grad-probe-every "$GRAD_PROBE_EVERY" "${cl[@]}" "${common[@]}" \
          > "$RES/pt_${s}_${arm}_s${seed}.log" 2>&1 &
        pids+=($!)
        if [ "$SERIAL" = 1 ]; then wait "$!" || ph "a pt run failed (pid $!)"; fi
      done
    done
  done
  [ "$SERIAL" = 1 ] || for p in "${pids[@]}"; do wait "$p" || ph "a pt run failed (pid $p)"; done
  ph "lct"
  pids=()
  for s in $LCT_SIZES; do
    for seed in $(for_size SEEDS "$s"); do
      for arm in $(for_size ARMS "$s"); do
        python3 "$T/train.py" --size "$s" --arm "$arm" --seed "$seed" --stage lct --seqlen 16384 \
          --budget-s "$LCT_BUDGET_S" --steps "$(for_size LCT_STEPS "$s")" --probe-steps 20 "${sync[@]}" --eval-every 25 "${cl[@]}" "${common[@]}" \
          > "$RES/lct_${s}_${arm}_s${seed}.log" 2>&1 &
        pids+=($!)
        if [ "$SERIAL" = 1 ]; then wait "$!" || ph "an lct run failed (pid $!)"; fi
      done
    done
  done
  [ "$SERIAL" = 1 ] || for p in "${pids[@]}"; do wait "$p" || ph "an lct run failed (pid $p)"; done
  ph "timing"
  A=(--data "$D" --tokenizer "$TOK" --out "$RES" --work "$W")
  T_A=("${A[@]}" "${cl[@]}")
  for s in $(skip timing || echo "$SIZES"); do
    seed0=$(for_size SEEDS "$s"); seed0=${seed0%% *}
    for arm in $(arms_analyzed "$s"); do
      python3 "$T/analyze.py" timing --size "$s" --arm "$arm" --seed "$seed0" --stage pt --seqlen 4096 \
        --profile "$RES/profile_${s}_${arm}_pt.txt" "${T_A[@]}" >> "$RES/timing.log" 2>&1 || ph "timing $s $arm pt failed"
      if [[ " $LCT_SIZES " == *" $s "* ]]; then
        python3 "$T/analyze.py" timing --size "$s" --arm "$arm" --seed "$seed0" --stage lct --seqlen 16384 "${T_A[@]}" >> "$RES/timing.log" 2>&1 || ph "timing $s $arm lct failed"
      fi
    done
  done
  ph "regime"
  for s in $(skip regime || echo "$LCT_SIZES"); do
    seed0=$(for_size SEEDS "$s"); seed0=${seed0%% *}
    for seed in $(for_size SEEDS "$s"); do
      for arm in $(arms_analyzed "$s"); do
        save=()
        [ "$arm" = mala ] && [ "$seed" = "$seed0" ] && save=(--save-states "$W/states_${s}_mala" --save-n 16384)
        python3 "$T/analyze.py" regime --size "$s" --arm "$arm" --seed "$seed" --stage lct "${save[@]}" "${A[@]}" \
          >> "$RES/regime.log" 2>&1 || ph "regime $s $arm seed $seed failed"
      done
    done
  done
  ph "grads"
  # The gradient's fidelity (analyze.py grads) on each arm of each size's first seed.
  for s in $(skip grads || echo "$LCT_SIZES"); do
    seed0=$(for_size SEEDS "$s"); seed0=${seed0%% *}
    for arm in $(for_size ARMS "$s"); do
      for nq in 4096:4:8 16384:1:4; do
        IFS=: read -r gn gs gb <<< "$nq"
        python3 "$T/analyze.py" grads --size "$s" --arm "$arm" --seed "$seed0" --stage lct --seqlen "$gn" \
          --sequences "$gs" --batches "$gb" "${A[@]}" >> "$RES/grads.log" 2>&1 || ph "grads $s $arm $gn failed"
      done
    done
  done
  if [ -n "$FA4_SITE" ]; then
    for _ in $(seq "$FA4_WAIT_S"); do [ -f "$FA4_SITE/.ready-fa4" ] && break; sleep 1; done
    ph "fa4 $([ -f "$FA4_SITE/.ready-fa4" ] && echo ready || echo "not ready after ${FA4_WAIT_S} s")"
  fi
  ph "speed"
  for s in $(skip speed || echo "${SPEED_SIZES:-$LCT_SIZES}"); do
    seed0=$(for_size SEEDS "$s"); seed0=${seed0%% *}
    for arm in $(arms_analyzed "$s"); do
      python3 "$T/analyze.py" speed --size "$s" --arm "$arm" --seed "$seed0" --stage lct --n 16384 "${A[@]}" >> "$RES/speed.log" 2>&1 || ph "speed $s $arm failed"
    done
  done
  # The matched-work study and the states: on the MALA-trained models.
  mala_sizes=$(for s in $LCT_SIZES; do if [[ " $(for_size ARMS "$s") " == *" mala "* ]]; then echo "$s"; fi; done)
  if [ -z "$mala_sizes" ] || skip matched; then ph "all done"; return; fi
  ph "matched"
  MW=$R/lab/real/matched_work.py
  for s in ${SPEED_SIZES:-$LCT_SIZES}; do
    [[ " $mala_sizes " == *" $s "* ]] || continue
    python3 "$MW" --device cuda --states "$W/states_${s}_mala" --n 8192 --key "${s}_8192" --out "$RES/matched_work.json" >> "$RES/matched.log" 2>&1 || ph "matched $s 8K failed"
    python3 "$MW" --device cuda --states "$W/states_${s}_mala" --key "${s}_16384" --out "$RES/matched_work.json" >> "$RES/matched.log" 2>&1 || ph "matched $s 16K failed"
  done
  # Two layers' states (the first and the last) of the smallest MALA-trained model: float16, the
  # first 8K rows, one file each (a file that comes back holds at most 16 MiB).
  s0=$(echo $mala_sizes | cut -d' ' -f1)
  mkdir -p "$RES/states"
  python3 - "$W/states_${s0}_mala" "$RES/states" <<'EOF' || ph "states copy failed"
import sys, glob, os, numpy as np
src, dst = sys.argv[1], sys.argv[2]
files = sorted(glob.glob(os.path.join(src, "layer*_q.npy")))
for f in (files[0], files[-1]):
    for x in "qkv":
        p = f.replace("_q.npy", f"_{x}.npy")
        np.save(os.path.join(dst, os.path.basename(p)), np.load(p)[:8192])
EOF
  ph "all done"
}

case "${1:-}" in
start)
  rm -rf "$STORE/repo" "$RES" && mkdir -p "$STORE/repo" "$RES"
  cp -r . "$STORE/repo/"
  export -f phases arms_analyzed for_size skip
  export SKIP SERIAL STORE SIZES SEEDS LCT_SIZES PT_BUDGET_S LCT_BUDGET_S PT_STEPS LCT_STEPS COMPILE_LOSS RES SPEED_SIZES FA4_SITE FA4_WAIT_S ARMS
  setsid nohup bash -c phases > "$STORE/phases.out" 2>&1 < /dev/null &
  echo "gpu_run: started (log $RES/phases.log)"
  ;;
wait)
  . lab/scripts/bg_wait.sh
  bg_wait "${2:-540}" "$RES/phases.log" "$STORE/phases.out" 3 "$RES"
  if [ -n "${OUT:-}" ]; then
    (cd "$RES" && tar czf "$OUT/train_results.tgz" --exclude='states' . 2>/dev/null) || true
    [ -d "$RES/states" ] && cp "$RES"/states/*.npy "$OUT/" 2>/dev/null || true
  fi
  ;;
*)
  echo "usage: gpu_run.sh start | wait [SECONDS]" >&2
  exit 2
  ;;
esac
