#!/usr/bin/env bash
# The associative-recall study (issue #65) on one GPU machine, in the background, across device
# calls (a call lasts at most 10 minutes; the machine is held while calls follow one another).
# docs/evaluation.md ("Associative recall against fixed-budget sparse attention") gives the commands.
#
#   there: bash lab/ar/gpu_run.sh start    copies this tree to $STORE/repo and runs every phase
#                                          there (setsid); returns at once
#   there: bash lab/ar/gpu_run.sh calib    the same, full alone at the head cell (see below), or
#                                          with CALIB_LRS one full cell per learning rate
#   there: bash lab/ar/gpu_run.sh wait [S] waits up to S seconds (default 540) or until the run ends;
#                                          prints the phase log and each log's tail; packs the results
#                                          into $OUT/ar_results.tgz
# Phases: build (the mala extension, in the background from the start), wheels (every .whl under
# .whl/ into $STORE/site: fla-core 0.6.0 and einops for nsa), gpu check (the GPU-only tests of
# lab/ar/tests: compiled flex_attention against the dense path for swa/moba/dsa, parallel_nsa against
# fla's naive reference, the nsa module against fla's gated sum), head (SEQLEN_HEAD x D_HEAD, every
# method, SEEDS_HEAD), trend (TREND_LENS at D_TREND, SEEDS_TREND), grid (GRID_LENS x GRID_DS,
# SEEDS_TREND; empty by default), timing (each method alone at SEQLEN_HEAD x D_HEAD for TIMING_STEPS
# steps), collect (ar.json, tables.md).
# Cells of one phase run PAR at a time on the one GPU, so their own step_ms is concurrent; the
# timing phase's is the one reported.
# Training is step-matched: every method takes STEPS optimizer steps per seed on the same batches,
# the LR schedule over steps.  TIME_CAP_S (head) and TREND_TIME_CAP_S (trend and grid), per seed,
# are a safety net only: a seed that reaches one stops, its cell records hit_time_cap and
# steps_done, and collect (ar.json "stopped_early", phases.log) and the tables flag that cell.
# Defaults sized for about 15 minutes of one H200 for head + trend, all six methods concurrent.
# The task is smaller than the paper's (8,192 x 512, 256 pairs, vocab 8,192): at that size not even
# full attention leaves chance in such a budget (the first runs: 3,000 steps of batch 32 at 1,024
# tokens stayed at loss 8.3 = ln 4,096; on the CPU, vocab 8,192 stays at chance for 1,500-3,000
# steps even with 8 pairs in 128 tokens, and vocab 256 with 64 pairs at d_model 64 for 1,500 steps
# of batch 32, while vocab 128 with 16 pairs is solved by ~1,250).  Head: 4,096 x 512, 16 pairs
# (N_KV), vocab 128 (VOCAB: 63 keys, 64 values, chance 1/64), seed 0; trend 1,024 and 2,048.
# STEPS = 1000 is not enough for this head cell: its GPU calibration (docs/evaluation.md), before the
# short conv in ar_model.py, ended at
# the in-context heuristic after 2,000 steps.  Calibrate first (`calib`: full alone, its loss every
# 50 steps; CALIB_LRS for several learning rates at once) and set STEPS to about 1.5x the step where
# full's accuracy leaves 1/N_KV; the caps at about twice the slowest cell's seed.
# Environment (defaults): STORE (/tmp/mala-ar), METHODS ("full mala swa moba dsa nsa"),
# SEQLEN_HEAD (4096), D_HEAD (512), SEEDS_HEAD ("0"), TREND_LENS ("1024 2048"),
# D_TREND (512), SEEDS_TREND ("0"), GRID_LENS (""), GRID_DS (""), PAR (6), STEPS (1000), BATCH (16),
# WARMUP (50), LR (1e-3), VOCAB (128), N_KV (16, also n_q), TIME_CAP_S (400), TREND_TIME_CAP_S (200),
# N_TRAIN (1000000), N_TEST (256), LOG_EVERY (100), GPU_CHECK (1), TIMING (1),
# TIMING_STEPS (20), TIMING_AFTER (a file the timing phase waits for, up to TIMING_WAIT_S (600), so
# that another job sharing the GPU has ended before steps are timed); for a dry run elsewhere:
# DEVICE (cuda), BUILD (1; 0 uses the mala already on PYTHONPATH), TASK_ARGS (extra ar_train.py
# train arguments, e.g. a tiny task).
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ "${1:-}" = calib ]; then
  # About 5 minutes of one H200: full alone at the head cell, one seed, loss logged every 50 steps;
  # no mala build, gpu check, trend or timing.  Then `wait` as after start.  The step at which the
  # loss in logs/head_*_full.log leaves its ln(N_KV) plateau sizes STEPS for the study.
  METHODS=${METHODS:-full} SEEDS_HEAD=${SEEDS_HEAD:-0} TREND_LENS=${TREND_LENS-} BUILD=${BUILD:-0}
  GPU_CHECK=${GPU_CHECK:-0} TIMING=${TIMING:-0} STEPS=${STEPS:-2000} TIME_CAP_S=${TIME_CAP_S:-240}
  LOG_EVERY=${LOG_EVERY:-50}
  # CALIB_LRS: one full cell per learning rate, all at once (cells/calib_lr<LR>.json and
  # logs/calib_lr<LR>.log), instead of the head cell at LR.
  CALIB_LRS=${CALIB_LRS:-}
  set -- start
fi
STORE=${STORE:-/tmp/mala-ar}
METHODS=${METHODS:-"full mala swa moba dsa nsa"}
SEQLEN_HEAD=${SEQLEN_HEAD:-4096}
D_HEAD=${D_HEAD:-512}
SEEDS_HEAD=${SEEDS_HEAD:-0}
TREND_LENS=${TREND_LENS-"1024 2048"}  # set empty for no trend
D_TREND=${D_TREND:-512}
SEEDS_TREND=${SEEDS_TREND:-0}
GRID_LENS=${GRID_LENS-}
GRID_DS=${GRID_DS-}
PAR=${PAR:-6}
STEPS=${STEPS:-1000}
BATCH=${BATCH:-16}
WARMUP=${WARMUP:-50}
VOCAB=${VOCAB:-128}
N_KV=${N_KV:-16}
LR=${LR:-1e-3}
TIME_CAP_S=${TIME_CAP_S:-400}
TREND_TIME_CAP_S=${TREND_TIME_CAP_S:-200}
N_TRAIN=${N_TRAIN:-1000000}
N_TEST=${N_TEST:-256}
TIMING_STEPS=${TIMING_STEPS:-20}
TIMING_AFTER=${TIMING_AFTER:-}
TIMING_WAIT_S=${TIMING_WAIT_S:-600}
DEVICE=${DEVICE:-cuda}
BUILD=${BUILD:-1}
TASK_ARGS=${TASK_ARGS:-}
LOG_EVERY=${LOG_EVERY:-100}
GPU_CHECK=${GPU_CHECK:-1}
TIMING=${TIMING:-1}
RES=$STORE/res

phases() {
  local R=$STORE/repo A=$STORE/repo/lab/ar
  export PYTHONPATH=$STORE/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
  mkdir -p "$RES/cells" "$RES/timing" "$RES/logs"
  cd "$R"
  ph() { echo "$(date +%T) $*" >> "$RES/phases.log"; }
  ph "start METHODS=$METHODS head=${SEQLEN_HEAD}x${D_HEAD} seeds=[$SEEDS_HEAD] trend=[$TREND_LENS]x$D_TREND" \
     "steps $STEPS batch $BATCH (step-matched; time caps ${TIME_CAP_S}s/${TREND_TIME_CAP_S}s per seed)"
  rm -rf "$STORE/site" "$STORE/build.done" "$STORE/build.failed"
  mkdir -p "$STORE/site"
  [ "$BUILD" = 1 ] || touch "$STORE/build.done"
  [ "$BUILD" = 1 ] && ( CMAKE_ARGS=-DCMAKE_CUDA_ARCHITECTURES=90a CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install \
      --no-build-isolation --no-deps --no-cache-dir --upgrade --target "$STORE/site" . > "$RES/build.log" 2>&1 \
      && touch "$STORE/build.done" || touch "$STORE/build.failed" ) &
  if ls .whl/*.whl > /dev/null 2>&1; then
    ph "wheels"
    python3 -m pip install --no-index --no-deps --target "$STORE/site" .whl/*.whl > "$RES/wheels.log" 2>&1 \
      || ph "wheels failed (nsa will be skipped)"
  fi
  while [ ! -f "$STORE/build.done" ]; do
    [ -f "$STORE/build.failed" ] && { ph "build failed"; exit 1; }
    sleep 2
  done
  ph "build done"
  if [ "$GPU_CHECK" = 1 ]; then
    ph "gpu check"
    python3 -m pytest -q -p no:cacheprovider "$A/tests/test_ar_methods.py" -k on_gpu > "$RES/gpu_check.log" 2>&1 \
      || ph "gpu check failed (see gpu_check.log)"
  fi
  # shellcheck disable=SC2206
  task=($TASK_ARGS)
  common=(--steps "$STEPS" --batch "$BATCH" --warmup "$WARMUP" --lr "$LR" --n-train "$N_TRAIN" --n-test "$N_TEST"
          --vocab "$VOCAB" --n-kv "$N_KV" --n-q "$N_KV" --log-every "$LOG_EVERY" --device "$DEVICE" "${task[@]}")
  # cells PHASE CAP SEEDS "LEN:D ..." : every method of every (LEN, D), PAR at a time
  cells() {
    local phase=$1 cap=$2 seeds=$3 shapes=$4 pids=() n d m
    ph "$phase"
    for nd in $shapes; do
      n=${nd%%:*} d=${nd##*:}
      for m in $METHODS; do
        # shellcheck disable=SC2086
        python3 "$A/ar_train.py" train --seqlen "$n" --d-model "$d" --method "$m" --seeds $seeds --time-cap-s "$cap" \
          "${common[@]}" --out "$RES/cells/${n}_${d}_${m}.json" > "$RES/logs/${phase}_${n}_${d}_${m}.log" 2>&1 &
        pids+=($!)
        if [ ${#pids[@]} -ge "$PAR" ]; then
          wait "${pids[0]}" || ph "a $phase cell failed (pid ${pids[0]})"
          pids=("${pids[@]:1}")
        fi
      done
    done
    for p in "${pids[@]}"; do wait "$p" || ph "a $phase cell failed (pid $p)"; done
  }
  if [ -n "${CALIB_LRS:-}" ]; then
    ph "calib lrs=[$CALIB_LRS]"
    local pids=() lr
    for lr in $CALIB_LRS; do
      # shellcheck disable=SC2086
      python3 "$A/ar_train.py" train --seqlen "$SEQLEN_HEAD" --d-model "$D_HEAD" --method full --seeds $SEEDS_HEAD \
        --time-cap-s "$TIME_CAP_S" "${common[@]}" --lr "$lr" --out "$RES/cells/calib_lr${lr}.json" \
        > "$RES/logs/calib_lr${lr}.log" 2>&1 &
      pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p" || ph "a calib cell failed (pid $p)"; done
    ph "all done"
    return
  fi
  cells head "$TIME_CAP_S" "$SEEDS_HEAD" "$SEQLEN_HEAD:$D_HEAD"
  trend=""
  for n in $TREND_LENS; do trend="$trend $n:$D_TREND"; done
  [ -n "$trend" ] && cells trend "$TREND_TIME_CAP_S" "$SEEDS_TREND" "$trend"
  grid=""
  for n in $GRID_LENS; do for d in $GRID_DS; do
    [ -f "$RES/cells/${n}_${d}_full.json" ] || grid="$grid $n:$d"
  done; done
  [ -n "$grid" ] && cells grid "$TREND_TIME_CAP_S" "$SEEDS_TREND" "$grid"
  if [ -n "$TIMING_AFTER" ]; then
    for _ in $(seq "$TIMING_WAIT_S"); do [ -e "$TIMING_AFTER" ] && break; sleep 1; done
    ph "timing after $TIMING_AFTER: $([ -e "$TIMING_AFTER" ] && echo present || echo "absent after ${TIMING_WAIT_S} s")"
  fi
  if [ "$TIMING" = 1 ]; then
    ph "timing"
    for m in $METHODS; do
      # the study's arguments, then the short run's own (the later flag wins)
      python3 "$A/ar_train.py" train --seqlen "$SEQLEN_HEAD" --d-model "$D_HEAD" --method "$m" --seeds 0 \
        "${common[@]}" --steps "$TIMING_STEPS" --n-test 16 --log-every 0 \
        --out "$RES/timing/${SEQLEN_HEAD}_${D_HEAD}_${m}.json" > "$RES/logs/timing_${m}.log" 2>&1 || ph "timing $m failed"
    done
  fi
  ph "collect"
  python3 "$A/ar_train.py" collect --cells "$RES/cells" --timing "$RES/timing" --out "$RES/ar.json" >> "$RES/phases.log" 2>&1
  python3 "$A/ar_report.py" "$RES/ar.json" > "$RES/tables.md" 2>> "$RES/phases.log" || ph "report failed"
  ph "all done"
}

case "${1:-}" in
start)
  rm -rf "$STORE/repo" "$RES" && mkdir -p "$STORE/repo" "$RES"
  cp -r . "$STORE/repo/"
  export -f phases
  export STORE METHODS SEQLEN_HEAD D_HEAD SEEDS_HEAD TREND_LENS D_TREND SEEDS_TREND GRID_LENS GRID_DS PAR STEPS \
    BATCH WARMUP VOCAB N_KV LOG_EVERY GPU_CHECK TIMING LR CALIB_LRS TIME_CAP_S TREND_TIME_CAP_S N_TRAIN N_TEST TIMING_STEPS TIMING_AFTER TIMING_WAIT_S DEVICE BUILD \
    TASK_ARGS RES
  setsid nohup bash -c phases > "$STORE/phases.out" 2>&1 < /dev/null &
  echo "gpu_run: started (log $RES/phases.log)"
  ;;
wait)
  . lab/scripts/bg_wait.sh
  bg_wait "${2:-540}" "$RES/phases.log" "$STORE/phases.out" 2 "$RES" "$RES/logs"
  if [ -n "${OUT:-}" ]; then
    (cd "$RES" && tar czf "$OUT/ar_results.tgz" .) 2>/dev/null || true
    for f in ar.json tables.md; do [ -f "$RES/$f" ] && cp "$RES/$f" "$OUT/"; done || true
  fi
  ;;
*)
  echo "usage: gpu_run.sh start | calib | wait [SECONDS]" >&2
  exit 2
  ;;
esac
