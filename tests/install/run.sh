#!/usr/bin/env bash
# The installed C++ package, used as a new user would (CTest install_consumer; CI):
#   tests/install/run.sh BUILD_DIR
# installs the already built BUILD_DIR into a temporary prefix (`cmake --install`, nothing is
# rebuilt), checks the installed files, then builds tests/install/consumer against it twice, with
# find_package(mala) and with the plain compiler line README.md gives, and runs both.
set -euo pipefail
build=$(cd "${1:?usage: run.sh BUILD_DIR}" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
src=$(cd "$here/../.." && pwd)
tmp=$(mktemp -d "${TMPDIR:-/tmp}/mala_install_test.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
prefix=$tmp/prefix
fail() { echo "install test: $*" >&2; exit 1; }
cache() { sed -n "s/^$1:[A-Z]*=//p" "$build/CMakeCache.txt"; }

cmake --install "$build" --prefix "$prefix" >/dev/null
cuda=$(cache MALA_CUDA)
libdir=$(find "$prefix" -name libmala.a -printf '%h\n' | head -1)
[ -n "$libdir" ] || fail "no libmala.a under $prefix"
for f in include/mala/mala.h bin/mala "${libdir#"$prefix"/}/cmake/mala/malaConfig.cmake" \
         "${libdir#"$prefix"/}/cmake/mala/malaConfigVersion.cmake"; do
  [ -e "$prefix/$f" ] || fail "not installed: $f"
done
if [ "$cuda" = ON ]; then [ -e "$libdir/libmala_cuda.a" ] || fail "MALA_CUDA=ON but no libmala_cuda.a"; fi
# Relocatable: the package names no path of the source or build tree.
if grep -rlF -e "$src/" -e "$build" "$libdir/cmake/mala"; then fail "installed package names the source or build tree"; fi
[ -x "$prefix/bin/mala" ] || fail "bin/mala is not executable"

# 1. CMake: find_package(mala 0.1 CONFIG REQUIRED), target_link_libraries(... mala::mala).
cmake -S "$here/consumer" -B "$tmp/consumer" -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_CXX_COMPILER="$(cache CMAKE_CXX_COMPILER)" >"$tmp/log" 2>&1 \
  || { cat "$tmp/log"; fail "consumer configure failed"; }
cmake --build "$tmp/consumer" >"$tmp/log" 2>&1 || { cat "$tmp/log"; fail "consumer build failed"; }
"$tmp/consumer/consumer"

# 2. Outside CMake, as README.md's "Using the C++ library" says.
libs=("$libdir/libmala.a")
if [ "$cuda" = ON ]; then
  cudalib=$(cd "$(dirname "$(cache CMAKE_CUDA_COMPILER)")/../lib64" && pwd)
  libs+=("$libdir/libmala_cuda.a" -L"$cudalib" -lcudart -Wl,-rpath,"$cudalib")
fi
"$(cache CMAKE_CXX_COMPILER)" -std=c++17 -O2 -fopenmp -I"$prefix/include" "$here/consumer/main.cpp" \
  "${libs[@]}" -o "$tmp/consumer_plain"
"$tmp/consumer_plain"
echo "install test: ok (MALA_CUDA=$cuda)"
