#!/usr/bin/env bash
# The C++ bad-input tests under AddressSanitizer + UndefinedBehaviorSanitizer (CI: scripts/dev.sh
# test runs this after ctest).  Builds only the CPU library and the CPU test binary (MALA_CUDA=OFF),
# so a read or write past a buffer, or a wrapped signed size, fails the run instead of passing
# silently.  Environment: ASAN_BUILD_DIR (default build-asan), JOBS (default nproc).
#   scripts/sanitize.sh [gtest filter]   (default: the bad-input, argument-check and .npy suites)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${ASAN_BUILD_DIR:-build-asan}
JOBS=${JOBS:-$(nproc)}
FILTER=${1:-'BadInput.*:Validate.*:Npy.*:Layout.*:Decode.*'}
flags="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
start=$(date +%s)
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMALA_CUDA=OFF -DMALA_TESTS=ON \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g" -DCMAKE_CXX_FLAGS="$flags" \
  -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" >/dev/null
cmake --build "$BUILD" -j "$JOBS" --target mala_tests >&2
# detect_leaks=0: OpenMP's thread pool is alive at exit; halt_on_error: the first report fails.
ASAN_OPTIONS=detect_leaks=0:halt_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  "$BUILD/tests/mala_tests" --gtest_filter="$FILTER" --gtest_brief=1
echo "sanitize.sh: passed in $(( $(date +%s) - start )) s"
