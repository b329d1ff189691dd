#!/usr/bin/env bash
# Issue #66 part 2 on a GPU machine: MALA against FlashInfer's skip-softmax (docs/benchmarks.md,
# "NVIDIA skip-softmax (FlashInfer)").
#
#   lab/scripts/skip_softmax.sh stage            # on the GPU, once per carried part (see below)
#   lab/scripts/skip_softmax.sh install          # on the GPU: step 1 alone (join, check, install), for
#                                                # other users of FlashInfer (lab/real/recipe.py)
#   MALA_GIT_COMMIT=... lab/scripts/skip_softmax.sh [--dry-run] [skip_softmax.py flags...]
#
# Wheels travel in .whl/fi/ (git-ignored; made here by `lab/scripts/skip_softmax.sh prepare`):
# parts of at most 40 MiB with SHA256SUMS.  A call carries one folder .whl/fi/callK; `stage`
# copies it into /tmp/fi-stage on the warm machine.  The run joins the parts, checks every
# sha256, installs everything into /tmp/site with pip --no-index --no-deps --target, then runs
# the suite's guard for the FlashInfer systems (run.py --sections guard) and skip_softmax.py,
# which writes OUT/skip_softmax.json.
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
START=$(date +%s)
STAGE=${FI_STAGE:-/tmp/fi-stage}
SITE=${MALA_BENCH_SITE:-/tmp/site}
OUT_DIR=${OUT:-skip_softmax_out}
log() { echo "[skip_softmax $(($(date +%s) - START))s] $*"; }

if [ "${1:-}" = "prepare" ]; then   # here, with network: download, split, checksum
  D=.whl/fi/all; mkdir -p "$D"
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d "$D" flashinfer-python==0.7.2.post1 apache-tvm-ffi==0.1.15.post2 \
    nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 \
    nvidia-cutlass-dsl-libs-cu13==4.8.1 nvidia-cudnn-frontend==1.32.0 cuda-tile==1.7.0 nccl4py==0.6.0 \
    nccl-extensions==0.1.0 cuda-python==13.4.4
  (cd "$D" && sha256sum *.whl > SHA256SUMS && for w in *.whl; do
     if [ "$(stat -c %s "$w")" -gt 41943040 ]; then split -b 40M -d "$w" "$w.part" && rm "$w"; fi; done)
  ls -la "$D"; echo "distribute $D into .whl/fi/call1.. (each <= 60 MiB) and carry one per call"
  exit 0
fi
if [ "${1:-}" = "stage" ]; then
  mkdir -p "$STAGE"; shopt -s nullglob
  for d in .whl/fi/call*; do cp -v "$d"/* "$STAGE"/; done
  ls -la "$STAGE"; exit 0
fi

DRY=0; for a in "$@"; do [ "$a" = "--dry-run" ] && DRY=1; done
if [ $DRY = 1 ]; then
  log "plan: join parts in $STAGE, check SHA256SUMS, pip --target $SITE, build mala unless importable,"
  log "      run.py --sections guard --systems sdpa_cudnn,fa4,mala,mala0,flashinfer,flashinfer_skip_softmax"
  log "      --fi-scale-factors 1,16,256 --ops fwd, then skip_softmax.py:"
  exec python3 lab/suite/skip_softmax.py --out "$OUT_DIR" "$@"
fi

# ---- 1. join, check, install ----------------------------------------------------------------------
install_wheels() {
  mkdir -p "$SITE" "$OUT_DIR"
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  if [ -f "$STAGE/SHA256SUMS" ]; then
    (cd "$STAGE" && for p in *.part00; do w=${p%.part00}; [ -f "$w" ] || cat "$w".part* > "$w"; done \
       && sha256sum -c SHA256SUMS) || { log "sha256 check FAILED"; exit 2; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      "$STAGE"/*.whl || log "WARNING: pip install of the flashinfer wheels failed"
  else
    log "no $STAGE/SHA256SUMS: flashinfer wheels not staged (FlashInfer reported unavailable)"
  fi
  shopt -s nullglob; other=(.whl/*.whl)   # FA4's and mala's wheels, as bench_suite.sh carries them
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
