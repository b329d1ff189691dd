#!/usr/bin/env bash
# Builds the `mala` Python package against the torch already installed (pip, scikit-build-core,
# CMake) into a temporary target directory and runs its pytest suite (python/tests).  Meant for the
# GPU machine; without a GPU the CUDA tests skip and the CPU ones run (CI runs it so, from scripts/dev.sh test).
#   scripts/python_check.sh [pytest args...]   (no test paths: every test under python/tests)
# Environment: PYTHON (default python3), MALA_PY_TARGET (install directory, default a new temp dir),
#   CMAKE_ARGS (default -DCMAKE_CUDA_ARCHITECTURES=90a, plus -DMALA_CUDA=ON|OFF by whether nvcc is
#   found unless CMAKE_ARGS sets it), JOBS (parallel build jobs, default nproc),
#   MALA_PY_LOG (pip's build log, default $MALA_PY_TARGET/build.log).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TARGET=${MALA_PY_TARGET:-$(mktemp -d /tmp/mala-py.XXXXXX)}
mkdir -p "$TARGET"
LOG=${MALA_PY_LOG:-$TARGET/build.log}
export CMAKE_ARGS=${CMAKE_ARGS:--DCMAKE_CUDA_ARCHITECTURES=90a}
# build-py/ is shared with install_python.sh and earlier runs: a MALA_CUDA cached there must not
# decide this build, so it is passed explicitly (ON where nvcc is found) unless CMAKE_ARGS names it.
case "$CMAKE_ARGS" in
  *MALA_CUDA=*) ;;
  *) if command -v nvcc >/dev/null; then CMAKE_ARGS="-DMALA_CUDA=ON $CMAKE_ARGS"; else CMAKE_ARGS="-DMALA_CUDA=OFF $CMAKE_ARGS"; fi ;;
esac
export CMAKE_BUILD_PARALLEL_LEVEL=${JOBS:-$(nproc)}

"$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpu', torch.cuda.is_available())"
echo "python_check: building into $TARGET (CMAKE_ARGS=$CMAKE_ARGS, jobs $CMAKE_BUILD_PARALLEL_LEVEL, log $LOG)"
start=$(date +%s)
if ! "$PYTHON" -m pip install --no-build-isolation --no-deps --no-cache-dir --upgrade -v --target "$TARGET" . \
     >"$LOG" 2>&1; then
  tail -n 60 "$LOG"
  echo "python_check: build failed (full log: $LOG)" >&2
  exit 1
fi
echo "python_check: built in $(( $(date +%s) - start )) s"
# pyproject.toml's testpaths points pytest at python/tests when no path is given.
PYTHONPATH="$TARGET${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m pytest -p no:cacheprovider -rs "$@"
