#!/usr/bin/env bash
# Issue #66 part 2 on a GPU machine: MALA against FlashInfer's skip-softmax (docs/benchmarks.md,
# "NVIDIA skip-softmax (FlashInfer)").
#
#   lab/scripts/skip_softmax.sh stage            # on the GPU, once per carried part (see below)
#   lab/scripts/skip_softmax.sh install          # on the GPU: step 1 alone (join, check, install), for
#                                                # other users of FlashInfer (lab/real/recipe.py)
#   MALA_GIT_COMMIT=... lab/scripts/skip_softmax.sh [--dry-run] [skip_softmax.py flags...]
#
# Wheels travel as two lab/scripts/wheels.sh sets, in parts of 38 MiB (git-ignored .whl/fi/callK,
# .whl/fa4/callK; `skip_softmax.sh prepare` makes fi).  A call carries one part folder; `stage`
# copies it to the warm machine.  The run installs both sets into /tmp/site (wheels.sh checks
# every part's and wheel's sha256), then runs the suite's guard for the FlashInfer systems
# (run.py --sections guard) and skip_softmax.py, which writes OUT/skip_softmax.json.
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
START=$(date +%s)
SITE=${MALA_BENCH_SITE:-/tmp/site}
OUT_DIR=${OUT:-skip_softmax_out}
log() { echo "[skip_softmax $(($(date +%s) - START))s] $*"; }

# The wheels: two sets of lab/scripts/wheels.sh.  fa4 (FlashAttention-4 and the nvidia-cutlass-dsl set
# FlashInfer needs too; docs/training.md gives its prepare line) and fi, FlashInfer's own:
FI_PINS=(flashinfer-python==0.7.2.post1 nvidia-cudnn-frontend==1.32.0 cuda-tile==1.7.0 nccl4py==0.6.0
         nccl-extensions==0.1.0 cuda-python==13.4.4)
if [ "${1:-}" = "prepare" ]; then   # here, with network
  exec lab/scripts/wheels.sh prepare fi 38 "${FI_PINS[@]}"
fi
if [ "${1:-}" = "stage" ]; then     # there, once per call carrying .whl/fi/callK or .whl/fa4/callK
  for set in fi fa4; do lab/scripts/wheels.sh stage "$set" > /dev/null; done
  ls -la /tmp/wheels-fi /tmp/wheels-fa4 2>/dev/null; exit 0
fi

DRY=0; for a in "$@"; do [ "$a" = "--dry-run" ] && DRY=1; done
if [ $DRY = 1 ]; then
  log "plan: install the fa4 and fi wheel sets into $SITE (wheels.sh), build mala unless importable,"
  log "      run.py --sections guard --systems sdpa_cudnn,fa4,mala,mala0,flashinfer,flashinfer_skip_softmax"
  log "      --fi-scale-factors 1,16,256 --ops fwd, then skip_softmax.py:"
  exec python3 lab/suite/skip_softmax.py --out "$OUT_DIR" "$@"
fi

# ---- 1. join, check, install ----------------------------------------------------------------------
install_wheels() {
  mkdir -p "$SITE" "$OUT_DIR"
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  for set in fa4 fi; do
    lab/scripts/wheels.sh install "$set" "$SITE" || log "$set wheels not staged: its systems are reported unavailable"
  done
  shopt -s nullglob; other=(.whl/*.whl)   # mala's wheel, as bench_suite.sh carries it
  [ ${#other[@]} -gt 0 ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target "$SITE" "${other[@]}"
  python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>&1 | tail -3
  export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a} MAX_JOBS=${MAX_JOBS:-16}
}
if [ "${1:-}" = "install" ]; then install_wheels; exit 0; fi
install_wheels

# ---- 2. guard (builds mala when needed), then the comparison --------------------------------------
MALA_BENCH_WALL_S=${GUARD_WALL_S:-300} lab/scripts/bench_suite.sh --out "$OUT_DIR/guard" --sections guard \
  --systems sdpa_cudnn,fa4,mala,mala0,flashinfer,flashinfer_skip_softmax --fi-scale-factors 1,16,256 \
  --ops fwd --no-plots
DEADLINE=$((START + ${SKIP_WALL_S:-570}))
python3 lab/suite/skip_softmax.py --out "$OUT_DIR" --deadline "$DEADLINE" "$@"
rc=$?
log "exit $rc; $(ls "$OUT_DIR" | tr '\n' ' ')"
exit $rc
