#!/usr/bin/env bash
# MALA benchmark suite on a GPU machine, in one command (docs/benchmarks.md):
#
#   MALA_GIT_COMMIT=$(git rev-parse HEAD) lab/scripts/bench_suite.sh [--quick] [--out DIR] [run.py flags...]
#   MALA_GIT_COMMIT=... lab/scripts/bench_suite.sh --dist 4 [--quick]        # tensor parallel (issue 6)
#
# 1. installs the wheels carried in .whl/ (flash-sparse-attn; a prebuilt mala wheel if one is there)
#    into /tmp/site with pip --no-index --no-deps --target (nothing is fetched: the GPU machines
#    have no network);
# 2. builds the mala package (pip wheel --no-build-isolation --no-deps ., CUDA arch 90a, 16 build
#    jobs) unless `import mala` already works, installs it into /tmp/site, and copies the wheel to
#    OUT so that a later call can carry it in .whl/ and skip the build (MALA_BENCH_BUILD=0 skips it);
# 3. runs lab/suite/run.py with a deadline: everything (results.json, plots, summary) is written
#    before MALA_BENCH_WALL_S (default 570 s) after this script started, whatever the build took.
# NVLink multicast stays off in every process (NCCL_NVLS_ENABLE=0 and friends).
set -uo pipefail
START=$(date +%s)
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1

OUT_DIR=${OUT:-bench_suite_out}
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  if [ "${args[$i]}" = "--out" ] && [ $((i + 1)) -lt ${#args[@]} ]; then OUT_DIR=${args[$((i + 1))]}; fi
done
mkdir -p "$OUT_DIR"
SITE=${MALA_BENCH_SITE:-/tmp/site}
mkdir -p "$SITE"
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
log() { echo "[bench_suite $(($(date +%s) - START))s] $*"; }

# ---- 0. compilation caches -------------------------------------------------------------------------
# Triton kernels (flash-sparse-attn compiles every autotune config per sequence-length bucket),
# Inductor's FlexAttention kernels and flash-sparse-attn's tuned launch configs all land in one
# folder; it is packed into OUT/bench_cache.tgz at the end (when under 15 MB) and unpacked from
# .whl/bench_cache.tgz when carried, so a second call skips most of the compiling and tuning.
CACHE_DIR=${MALA_BENCH_CACHE_DIR:-/tmp/mala_bench_cache}
mkdir -p "$CACHE_DIR/triton" "$CACHE_DIR/inductor" "$CACHE_DIR/fsa_launch"
export TRITON_CACHE_DIR="$CACHE_DIR/triton" TORCHINDUCTOR_CACHE_DIR="$CACHE_DIR/inductor"
export FLASH_SPARSE_ATTENTION_LAUNCH_CONFIG_DIR="$CACHE_DIR/fsa_launch"
if [ -f .whl/bench_cache.tgz ]; then
  tar -xzf .whl/bench_cache.tgz -C "$CACHE_DIR" && log "unpacked carried compilation caches ($(du -sh "$CACHE_DIR" | cut -f1))"
fi
save_cache() {
  [ "${MALA_BENCH_SAVE_CACHE:-1}" = "1" ] || return 0
  local size
  size=$(du -sm "$CACHE_DIR" | cut -f1)
  if [ "$size" -lt 60 ]; then
    tar -czf "$OUT_DIR/bench_cache.tgz" -C "$CACHE_DIR" . 2>/dev/null
    local packed
    packed=$(du -m "$OUT_DIR/bench_cache.tgz" | cut -f1)
    if [ "$packed" -ge 15 ]; then
      rm -f "$OUT_DIR/bench_cache.tgz"
      log "compilation caches too large to bring back (${packed} MB packed)"
    else
      log "compilation caches packed into $OUT_DIR/bench_cache.tgz (${packed} MB): copy to .whl/ to reuse"
    fi
  else
    log "compilation caches too large to bring back (${size} MB)"
  fi
}

# ---- 1. carried wheels ---------------------------------------------------------------------------
shopt -s nullglob
wheels=(.whl/*.whl)
if [ ${#wheels[@]} -gt 0 ]; then
  log "installing carried wheels: ${wheels[*]}"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}" \
    || log "WARNING: pip install of the carried wheels failed"
else
  log "no carried wheels in .whl/ (flash-sparse-attn will be reported unavailable)"
fi

# ---- 2. the mala package -------------------------------------------------------------------------
if python3 -c "import mala" 2>/dev/null; then
  log "mala importable: $(python3 -c 'import mala; print(mala.__file__)')"
elif [ "${MALA_BENCH_BUILD:-1}" = "1" ]; then
  log "building mala (CUDA arch ${MALA_CUDA_ARCH:-90a}, ${MALA_BUILD_JOBS:-16} jobs)"
  WHEEL_DIR=$(mktemp -d)
  if CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=${MALA_CUDA_ARCH:-90a} ${CMAKE_ARGS:-}" \
     CMAKE_BUILD_PARALLEL_LEVEL=${MALA_BUILD_JOBS:-16} \
     timeout "${MALA_BUILD_TIMEOUT_S:-330}" \
     python3 -m pip wheel -q --no-build-isolation --no-deps --no-cache-dir -w "$WHEEL_DIR" . >"$OUT_DIR/mala_build.log" 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEEL_DIR"/mala-*.whl \
      && cp "$WHEEL_DIR"/mala-*.whl "$OUT_DIR"/ 2>/dev/null
    log "mala built in $(($(date +%s) - START))s since start; wheel copied to $OUT_DIR (carry it in .whl/ next time)"
  else
    log "mala build FAILED (see $OUT_DIR/mala_build.log); the suite reports mala as unavailable"
    tail -n 30 "$OUT_DIR/mala_build.log"
  fi
  python3 -c "import mala; print('mala', mala.__version__, mala.__file__)" || log "mala still not importable"
else
  log "mala not importable and MALA_BENCH_BUILD=0: reported as unavailable"
fi

# ---- 3. the suite --------------------------------------------------------------------------------
DEADLINE=$((START + ${MALA_BENCH_WALL_S:-570}))
log "running the suite (deadline in $((DEADLINE - $(date +%s))) s)"
python3 lab/suite/run.py --out "$OUT_DIR" --deadline "$DEADLINE" "$@"
rc=$?
save_cache
log "suite exit status $rc; outputs in $OUT_DIR: $(ls "$OUT_DIR" | tr '\n' ' ')"
exit $rc
