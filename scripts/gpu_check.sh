#!/usr/bin/env bash
# GPU checks, in two halves so that compiling never costs GPU time:
#   scripts/gpu_check.sh build            here (nvcc, GoogleTest, no GPU needed): builds the GPU tests, the
#                                         benchmark and the CLI for sm_90a into build-gpu/ and stages the
#                                         binaries in .carry/gpu/
#   scripts/gpu_check.sh run [--quick]    on the GPU machine (device tool: carry [".carry/gpu"], or
#                                         [".carry/gpu.tar.xz"] when that passes 64 MiB): GPU tests
#                                         (every kernel against the CPU implementation; the tests select
#                                         each kernel variant in-process, as a gtest parameter),
#                                         compute-sanitizer memcheck + racecheck on the small-shape tests
#                                         (every variant), the benchmark, and `mala report` on the GPU.
#                                         Logs go to $OUT (or gpu-logs/).
# Environment: CUDA_ARCHS (default 90a), MALA_BENCH_ARGS (extra benchmark flags),
#              MALA_SANITIZER_FILTER (gtest filter of the small-shape tests, default *Small*).
set -uo pipefail
cd "$(dirname "$0")/.."
step=${1:-run}
shift || true

case "$step" in
build)
  set -e
  cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DMALA_CUDA=ON \
        -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHS:-90a}" >/dev/null
  cmake --build build-gpu -j "$(nproc)" --target mala_gpu_tests mala_bench mala_cli
  mkdir -p .carry/gpu
  cp build-gpu/tests/mala_gpu_tests build-gpu/bench/mala_bench build-gpu/cli/mala .carry/gpu/
  cp scripts/gpu_check.sh .carry/gpu/
  # The binaries compress about 6x: carry the archive when they and the tree pass the 64 MiB a call takes.
  tar cJf .carry/gpu.tar.xz .carry/gpu
  du -sh .carry/gpu .carry/gpu.tar.xz
  ;;
run)
  quick=0
  [ "${1:-}" = "--quick" ] && quick=1
  bin=.carry/gpu
  [ -x "$bin/mala_gpu_tests" ] || tar xJf .carry/gpu.tar.xz
  out=${OUT:-gpu-logs}
  mkdir -p "$out"
  status=0
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/device.txt"
  echo "== GPU tests (every kernel against the CPU implementation, every kernel variant)"
  "$bin/mala_gpu_tests" --gtest_brief=1 2>&1 | tee "$out/gpu_tests.log" | tail -40 || status=1
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  if command -v compute-sanitizer >/dev/null; then
    filter=${MALA_SANITIZER_FILTER:-*Small*}
    for tool in memcheck racecheck; do
      echo "== compute-sanitizer $tool ($filter)"
      compute-sanitizer --tool "$tool" --error-exitcode 3 "$bin/mala_gpu_tests" --gtest_brief=1 \
        --gtest_filter="$filter" >"$out/sanitizer_$tool.log" 2>&1
      rc=$?
      tail -3 "$out/sanitizer_$tool.log"
      [ $rc = 0 ] || { echo "compute-sanitizer $tool: exit $rc"; status=1; }
      # racecheck reports hazards it only suspects as warnings, which do not set the exit code
      if grep "hazards displayed" "$out/sanitizer_$tool.log" | grep -qv " 0 hazards displayed (0 errors, 0 warnings)"; then
        echo "compute-sanitizer $tool: hazards reported"; status=1
      fi
    done
  fi
  echo "== benchmark"
  if [ $quick = 1 ]; then
    "$bin/mala_bench" --quick ${MALA_BENCH_ARGS:-} 2>&1 | tee "$out/bench.log" || status=1
  else
    "$bin/mala_bench" ${MALA_BENCH_ARGS:-} 2>&1 | tee "$out/bench.log" || status=1
  fi
  echo "== mala report on the GPU"
  "$bin/mala" report --device cuda --n 8192 2>&1 | tee "$out/report.log" || status=1
  echo "gpu_check: $([ $status = 0 ] && echo PASS || echo FAIL)"
  exit $status
  ;;
*)
  echo "gpu_check.sh: unknown step '$step' (build | run [--quick])" >&2
  exit 2
  ;;
esac
