#!/usr/bin/env bash
# CMake's compiler launcher for mala_cuda's CUDA objects (src/cuda/CMakeLists.txt): runs the compile
# unchanged and keeps its stderr -- ptxas's register-spill warnings among it -- beside the object as
# OBJ.ptxas.log, for the kernel_spills test (tests/kernel_spills.sh).
# Of a compile that succeeds, the build's stderr gets every line but the expected ones: ptxas's
# spill warnings (budgeted in tests/kernel_spills.txt) and its C7519 notes (warpgroup.arrive
# injected around a wgmma), which a reader of the build cannot act on.  A failed compile shows all.
#   scripts/nvcc_log.sh COMPILER ARGS...     the launcher
#   scripts/nvcc_log.sh --summary DIR        one line on the kept messages of every object under DIR
#                                            (mala_cuda's POST_BUILD step)
if [ "${1:-}" = --summary ]; then
  dir=${2:?--summary needs a directory}
  here=$(cd "$(dirname "$0")" && pwd)
  mapfile -t logs < <(find "$dir" -name '*.ptxas.log' | sort)
  [ ${#logs[@]} -gt 0 ] || exit 0
  spills=$(cat "${logs[@]}" | grep -c "Registers are spilled to local memory" || true)
  notes=$(cat "${logs[@]}" | grep -c "(C7519)" || true)
  if bash "$here/../tests/kernel_spills.sh" "$dir" >/dev/null 2>&1; then
    verdict="within tests/kernel_spills.txt"
  else
    verdict="OVER the budget in tests/kernel_spills.txt (ctest -R kernel_spills says which)"
  fi
  echo "mala_cuda: ptxas: $spills register-spill warnings, $verdict; $notes C7519 notes;" \
       "kept in each object's .ptxas.log (${#logs[@]} objects)"
  exit 0
fi
out="" prev=""
for a in "$@"; do
  [ "$prev" = "-o" ] && out=$a
  prev=$a
done
[ -n "$out" ] || exec "$@"
"$@" 2>"$out.ptxas.tmp"
rc=$?
if [ $rc = 0 ]; then
  grep -v -e "^ptxas warning : Registers are spilled to local memory in function" \
          -e "^ptxas info *: (C7519) " "$out.ptxas.tmp" >&2
else
  cat "$out.ptxas.tmp" >&2
fi
mv -f "$out.ptxas.tmp" "$out.ptxas.log"
exit $rc
