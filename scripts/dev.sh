#!/usr/bin/env bash
# One entry point for a fresh machine: installs what the build needs (Debian packages), configures,
# builds, then runs the requested step.
#   scripts/dev.sh report [mala report flags...]   build and run `mala report`
#   scripts/dev.sh test                            build and run every CPU test (what CI runs): ctest, then
#                                                  the real-model tools' tests (tools/real/tests) in the
#                                                  pinned environment tools/real/setup.sh makes
#   scripts/dev.sh build                           build only
# Environment: BUILD_DIR (default build), MALA_CUDA=ON|OFF (default: ON when nvcc is found),
#              JOBS (default: nproc).
set -euo pipefail
cd "$(dirname "$0")/.."
step=${1:-test}
shift || true
BUILD_DIR=${BUILD_DIR:-build}
JOBS=${JOBS:-$(nproc)}

install_deps() {
  local need=()
  command -v cmake >/dev/null || need+=(cmake)
  command -v g++ >/dev/null || need+=(g++)
  [ -f /usr/include/gtest/gtest.h ] || need+=(libgtest-dev)
  [ -f /usr/lib/x86_64-linux-gnu/libgtest.a ] || [ -f /usr/lib/aarch64-linux-gnu/libgtest.a ] || need+=(libgtest-dev)
  if [ ${#need[@]} -gt 0 ]; then
    echo "dev.sh: installing ${need[*]}"
    local sudo=""
    [ "$(id -u)" = 0 ] || sudo=sudo
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}"
  fi
}

configure_and_build() {
  local extra=()
  [ -n "${MALA_CUDA:-}" ] && extra+=(-DMALA_CUDA="$MALA_CUDA")
  cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release "${extra[@]}" >/dev/null
  cmake --build "$BUILD_DIR" -j "$JOBS"
}

install_deps
configure_and_build
case "$step" in
  build) ;;
  report) "$BUILD_DIR/tools/mala" report "$@" ;;
  test)
    ctest --test-dir "$BUILD_DIR" --output-on-failure -j "$JOBS" "$@"
    bash tools/real/setup.sh
    .venv-real/bin/python -m pytest -q -p no:cacheprovider tools/real/tests
    ;;
  *) echo "dev.sh: unknown step '$step' (report | test | build)" >&2; exit 2 ;;
esac
