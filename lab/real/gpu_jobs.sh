#!/usr/bin/env bash
# The model-in-the-loop experiments on the GPU machine, one after another in the background, so that
# they run across device calls (one call lasts at most 10 minutes; the machine is held while calls
# follow one another).  Run after `lab/real/stage.sh build` and the 22 `receive` calls
# (docs/real.md); the jobs start once the mala build there is done.
#
#   there: bash lab/real/gpu_jobs.sh start JOB [JOB ...]   copies this tree to $STORE/repo and runs
#                                                            the jobs there (setsid); returns at once
#   there: bash lab/real/gpu_jobs.sh wait [SECONDS]        waits up to SECONDS (default 540) or until
#                                                            every job has ended; prints the job log and
#                                                            each log's tail; packs the results into
#                                                            $OUT/real_results.tgz
# Jobs (docs/evaluation.md gives each one's command and device time):
#   e2e         qwen_e2e.py: whole-model prefill 8K/16K/32K, decode at 32K, batch 1 and 8
#   niah        qwen_niah.py: 4K-32K, 50 trials per variant, tau = 1
#   train       qwen_train.py: 120 steps dense, then MALA tau = 1
#   states      qwen_measure.py --steps load,states,save (the matched-work study's input)
#   speed       qwen_measure.py --steps load,states,speed at 32K: every layer's forward and backward,
#               MALA tau = 1 and 0 against SDPA cuDNN, on sequence 0's states
#   matched     matched_work.py --device cuda at 8K and 32K, every layer (after `states`)
#   decode      python/benchmarks/decode_timing.py: synthetic and random caches at 1K to 128K and the
#               real 32K cache of layers 0, 14, 27 (after `states`), at 0 (automatic) to 132 splits
#   pytest      the package's Python tests (CUDA ones included)
#   recipe      recipe.py at 32K: prefill time, retained tiles, perplexity (8 sequences) and multi-key
#               needles (50 trials) for dense cuDNN, MALA at each tau, per-layer tau and FlashInfer's
#               skip-softmax (issue #66 part 3); FlashInfer from $MALA_BENCH_SITE (default /tmp/site)
#               when `lab/scripts/skip_softmax.sh stage` and `install` put it there, else those arms
#               record Unsupported
# Results and logs: $STORE/res (STORE = $MALA_REAL_STORE, default /tmp/mala-real).
set -euo pipefail
cd "$(dirname "$0")/../.."
STORE=${MALA_REAL_STORE:-/tmp/mala-real}
RES=$STORE/res
GGUF=$STORE/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
export PYTHONPATH=$STORE/site${PYTHONPATH:+:$PYTHONPATH}
# The commit of the mala build (stage.sh build), which qwen_measure.py records in its results.
if [ -z "${MALA_COMMIT:-}" ] && [ -f "$STORE/mala-src/COMMIT" ]; then
  MALA_COMMIT=$(cat "$STORE/mala-src/COMMIT")
  export MALA_COMMIT
fi

job() {
  case "$1" in
  e2e) python3 lab/real/qwen_e2e.py --gguf "$GGUF" --out "$RES" --lengths 8192,16384,32768 --context 32768 \
         --batches 1,8 --new-tokens 64 ;;
  niah) python3 lab/real/qwen_niah.py --gguf "$GGUF" --out "$RES" --lengths 4096,8192,16384,32768 --trials 50 \
         --taus 1 ;;
  train)
    python3 lab/real/qwen_train.py --gguf "$GGUF" --out "$RES" --attn dense --seqlen 16384 --steps 120 \
      --eval-every 20 --deadline-s 100000
    python3 lab/real/qwen_train.py --gguf "$GGUF" --out "$RES" --attn mala --tau 1 --seqlen 16384 --steps 120 \
      --eval-every 20 --deadline-s 100000 ;;
  states) python3 lab/real/qwen_measure.py --gguf "$GGUF" --out "$RES" --steps load,states,save --sequences 1 \
            --lengths 8192,32768 --sweep 1 ;;
  speed) python3 lab/real/qwen_measure.py --gguf "$GGUF" --out "$RES" --steps load,states,speed --sequences 1 \
           --lengths 32768 --sweep 1 ;;
  matched)
    python3 lab/real/matched_work.py --device cuda --states "$STORE/work/states" --n 8192 --key 8192 \
      --out "$RES/matched_work.json"
    python3 lab/real/matched_work.py --device cuda --states "$STORE/work/states" --key 32768 \
      --out "$RES/matched_work.json" ;;
  decode)
    S=$STORE/work/states
    python3 python/benchmarks/decode_timing.py --seqlens 1024 8192 32768 131072 --batches 1 8 --regimes synthetic random \
      --real "$S/layer00,$S/layer14,$S/layer27" --num-splits 0 16 33 66 132 --out "$RES/decode_timing.json" ;;
  pytest) python3 -m pytest -q -p no:cacheprovider python/tests lab/real/tests ;;
  recipe)
    FI_SITE=${MALA_BENCH_SITE:-/tmp/site}
    if [ -d "$FI_SITE/flashinfer" ]; then  # after $STORE/site: its mala build stays first
      export PYTHONPATH="$PYTHONPATH:$FI_SITE" FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a} \
        MAX_JOBS=${MAX_JOBS:-16}
    fi
    python3 lab/real/recipe.py --gguf "$GGUF" --out "$RES" --n 32768 --sequences 8 --trials 50 ;;
  *) echo "gpu_jobs: unknown job $1" >&2; return 2 ;;
  esac
}

case "${1:-}" in
start)
  shift
  [ $# -gt 0 ] || { echo "usage: gpu_jobs.sh start JOB [JOB ...]" >&2; exit 2; }
  for j in "$@"; do case "$j" in e2e|niah|train|states|speed|matched|decode|pytest|recipe) ;; *) echo "gpu_jobs: unknown job $j" >&2; exit 2;; esac; done
  mkdir -p "$RES"
  rm -rf "$STORE/repo" && mkdir -p "$STORE/repo" && cp -r . "$STORE/repo/"
  setsid nohup bash -c "
    cd '$STORE/repo'
    while [ ! -f '$STORE/build.done' ]; do [ -f '$STORE/build.failed' ] && { echo 'build failed' >> '$RES/jobs.log'; exit 1; }; sleep 5; done
    for j in $*; do
      echo \"\$(date +%T) start \$j\" >> '$RES/jobs.log'
      bash lab/real/gpu_jobs.sh run \$j > '$RES/'\$j.log 2>&1 && rc=0 || rc=\$?
      echo \"\$(date +%T) end \$j rc=\$rc\" >> '$RES/jobs.log'
    done
    echo \"\$(date +%T) all done\" >> '$RES/jobs.log'" > /dev/null 2>&1 < /dev/null &
  echo "gpu_jobs: started $* (log $RES/jobs.log)"
  ;;
run)
  job "$2"
  ;;
wait)
  limit=${2:-540}
  start=$(date +%s)
  while ! grep -q "all done\|build failed" "$RES/jobs.log" 2>/dev/null && [ $(( $(date +%s) - start )) -lt "$limit" ]; do
    sleep 10
  done
  cat "$RES/jobs.log" 2>/dev/null || true
  for f in "$RES"/*.log; do [ "$f" = "$RES/jobs.log" ] || { echo "== $(basename "$f")"; tail -n 4 "$f" | cut -c1-240; }; done
  if [ -n "${OUT:-}" ]; then
    (cd "$RES" && tar czf "$OUT/real_results.tgz" --exclude='*.pt' ./*.json ./*.log 2>/dev/null) || true
  fi
  ;;
*)
  echo "usage: gpu_jobs.sh start JOB [JOB ...] | wait [SECONDS]   (jobs: e2e niah train states speed matched decode pytest recipe)" >&2
  exit 2
  ;;
esac
