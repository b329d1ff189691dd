#!/usr/bin/env bash
# One entry point for a fresh machine: installs what the build needs (Debian packages), configures,
# builds, then runs the requested step.
#   scripts/dev.sh report [mala report flags...]   build and run `mala report`
#   scripts/dev.sh test                            build and run every CPU test (what CI runs): ctest, the
#                                                  C++ bad-input tests under ASan + UBSan (scripts/sanitize.sh,
#                                                  build-asan), then the Python package's tests and the lab's
#                                                  (python/tests, lab/real/tests, lab/suite, lab/train/tests,
#                                                  lab/ar/tests and tests/docs: the docs' links) in .venv-py
#   scripts/dev.sh build                           build only
# Build and install output goes to stderr, so stdout carries only the step's own output
# (`dev.sh report --json` prints one JSON object).  An unknown step is rejected before building.
# Environment: BUILD_DIR (default build), MALA_CUDA=ON|OFF (default: ON when nvcc is found),
#              JOBS (default: nproc).
set -euo pipefail
cd "$(dirname "$0")/.."
step=${1:-test}
shift || true
BUILD_DIR=${BUILD_DIR:-build}
JOBS=${JOBS:-$(nproc)}
case "$step" in
  build|report|test) ;;
  *) echo "dev.sh: unknown step '$step' (report | test | build)" >&2; exit 2 ;;
esac

install_deps() {
  local need=()
  command -v cmake >/dev/null || need+=(cmake)
  command -v g++ >/dev/null || need+=(g++)
  [ -f /usr/include/gtest/gtest.h ] || need+=(libgtest-dev)
  [ -f /usr/lib/x86_64-linux-gnu/libgtest.a ] || [ -f /usr/lib/aarch64-linux-gnu/libgtest.a ] || need+=(libgtest-dev)
  if [ ${#need[@]} -gt 0 ]; then
    echo "dev.sh: installing ${need[*]}" >&2
    local sudo=""
    [ "$(id -u)" = 0 ] || sudo=sudo
    $sudo apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >&2
  fi
}

configure_and_build() {
  local extra=()
  [ -n "${MALA_CUDA:-}" ] && extra+=(-DMALA_CUDA="$MALA_CUDA")
  cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release "${extra[@]}" >/dev/null
  cmake --build "$BUILD_DIR" -j "$JOBS" >&2
}

# The Python package (python/) and the lab's studies (lab/real/, lab/suite/) on the CPU: a pinned venv
# (.venv-py, python/requirements-ci.txt: PyPI's torch, transformers, gguf), the extension built
# without CUDA kernels into a temporary folder, then pytest (the CUDA tests skip without a GPU).
python_tests() {
  [ -x .venv-py/bin/python ] || python3 -m venv .venv-py
  # PyPI's torch brings its CUDA libraries: about 5 GiB installed, 3 GiB more while pip unpacks.
  # Warn up front, so that a pip failing half-way with ENOSPC is explained.  A first install takes
  # minutes: pip then shows each download (and its progress bar on a terminal) instead of -q.
  local quiet=(-q)
  if ! .venv-py/bin/python -c "import torch" 2>/dev/null; then
    quiet=()
    echo "dev.sh: installing the Python test environment into .venv-py (python/requirements-ci.txt:" \
         "torch with its CUDA wheels, about 5 GiB; pip unpacks for minutes after the downloads)" >&2
    local free_kib
    free_kib=$(df -Pk . | awk 'NR == 2 { print $4 }')
    if [ "${free_kib:-0}" -lt $((8 * 1024 * 1024)) ]; then
      echo "dev.sh: warning: the Python test environment (.venv-py: torch and its CUDA wheels) needs" \
           "about 8 GiB free while it installs; $((free_kib / 1024 / 1024)) GiB is free on" \
           "$(df -P . | awk 'NR == 2 { print $6 }')" >&2
    fi
  fi
  .venv-py/bin/pip install "${quiet[@]}" --disable-pip-version-check --no-cache-dir -r python/requirements-ci.txt >&2
  [ ${#quiet[@]} -gt 0 ] || echo "dev.sh: .venv-py installed; building the extension and running pytest" >&2
  PYTHON=.venv-py/bin/python CMAKE_ARGS="-DMALA_CUDA=OFF" JOBS="$JOBS" \
    bash scripts/python_check.sh -q python/tests lab/real/tests lab/suite lab/train/tests lab/ar/tests tests/docs
}

install_deps
configure_and_build
# (the step was validated above, before the build)
case "$step" in
  build) ;;
  report) "$BUILD_DIR/cli/mala" report "$@" ;;
  test)
    ctest --test-dir "$BUILD_DIR" --output-on-failure -j "$JOBS" "$@"
    # The bad-input tests again under ASan + UBSan (CPU library and test binary only).
    JOBS="$JOBS" bash scripts/sanitize.sh
    python_tests
    ;;
  *) echo "dev.sh: unknown step '$step' (report | test | build)" >&2; exit 2 ;;
esac
