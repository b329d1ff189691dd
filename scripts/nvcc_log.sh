#!/usr/bin/env bash
# CMake's compiler launcher for mala_cuda's CUDA objects (src/cuda/CMakeLists.txt): runs the compile
# unchanged and keeps its stderr -- ptxas's register-spill warnings among it -- beside the object as
# OBJ.ptxas.log, for the kernel_spills test (tests/kernel_spills.sh).  The messages still reach the
# build's stderr, after the compile.
out="" prev=""
for a in "$@"; do
  [ "$prev" = "-o" ] && out=$a
  prev=$a
done
[ -n "$out" ] || exec "$@"
"$@" 2>"$out.ptxas.tmp"
rc=$?
cat "$out.ptxas.tmp" >&2
mv -f "$out.ptxas.tmp" "$out.ptxas.log"
exit $rc
