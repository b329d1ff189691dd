#!/usr/bin/env bash
# Installs the `mala` Python package into the current Python environment, built against the torch
# already installed there (one command; docs/python.md):
#   bash scripts/install_python.sh                 GPU kernels when nvcc is found, else a CPU-only build
#   bash scripts/install_python.sh --cpu           CPU-only build (the exact CPU implementation)
#   bash scripts/install_python.sh --wheel DIR     build a wheel into DIR instead of installing it
# It ends by saying whether the installed extension (or the wheel) has CUDA kernels, and fails when
# CUDA kernels were asked for (no --cpu, nvcc found) and the result has none.
# Environment: PYTHON (default python3), MALA_CUDA_ARCHS (default: the visible GPU's, e.g. 90a, or
#   "80;90a" without a visible GPU), JOBS (parallel compile jobs, default nproc).
# Prerequisites: torch (pip install torch), a C++17 compiler, CMake >= 3.25; scikit-build-core is
# installed here if missing; CUDA kernels need nvcc (the CUDA toolkit, 12.4 or newer).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
cpu=0 wheel=""
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) cpu=1 ;;
    --wheel) wheel=${2:?--wheel needs a directory}; shift ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "install_python.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
  shift
done
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
  echo "install_python.sh: torch is not importable by $PYTHON; install it first (pip install torch)" >&2
  exit 2
fi
"$PYTHON" -c "import scikit_build_core" 2>/dev/null || "$PYTHON" -m pip install "scikit-build-core==1.1.2"
command -v cmake >/dev/null || { echo "install_python.sh: cmake (>= 3.25) not found" >&2; exit 2; }
if [ $cpu = 0 ] && ! command -v nvcc >/dev/null; then
  echo "install_python.sh: nvcc not found: building the CPU implementation only (install the CUDA toolkit for the kernels)"
  cpu=1
fi
# MALA_CUDA is passed both ways: scikit-build-core reuses build-py/ between runs, and a cached
# MALA_CUDA=OFF from an earlier --cpu build would otherwise give a GPU build without kernels.
if [ $cpu = 1 ]; then
  export CMAKE_ARGS="-DMALA_CUDA=OFF ${CMAKE_ARGS:-}"
else
  archs=${MALA_CUDA_ARCHS:-$("$PYTHON" -c "import torch
if torch.cuda.is_available():
    major, minor = torch.cuda.get_device_capability()
    print(f'{major}{minor}' + ('a' if major == 9 else ''))
else:
    print('80;90a')")}
  export CMAKE_ARGS="-DMALA_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=$archs ${CMAKE_ARGS:-}"
fi
export CMAKE_BUILD_PARALLEL_LEVEL=${JOBS:-$(nproc)}
echo "install_python.sh: CMAKE_ARGS=$CMAKE_ARGS, $CMAKE_BUILD_PARALLEL_LEVEL jobs (compiler output follows)"
if [ -n "$wheel" ]; then
  mkdir -p "$wheel"
  stamp=$(mktemp)
  "$PYTHON" -m pip wheel --no-build-isolation --no-deps -v -w "$wheel" .
else
  "$PYTHON" -m pip install --no-build-isolation --no-deps -v .
fi

# What was built.  An install: the operators have CUDA implementations, which ops.cpp registers only
# when both libmala's kernels and torch's CUDA are built in.  A wheel (not importable here): its
# extension carries device code (an .nv_fatbin section) and links torch's CUDA (libc10_cuda).
if [ -n "$wheel" ]; then
  whl=$(find "$wheel" -maxdepth 1 -name 'mala-*.whl' -newer "$stamp" | head -n 1)
  rm -f "$stamp"
  [ -n "$whl" ] || { echo "install_python.sh: no new mala wheel in $wheel" >&2; exit 1; }
  kernels=$("$PYTHON" - "$whl" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    so = [n for n in z.namelist() if n.startswith("mala/_C") and n.endswith(".so")]
    data = z.read(so[0]) if so else b""
    print("yes" if b".nv_fatbin" in data and b"libc10_cuda.so" in data else "no")
PY
)
  size=$(du -h "$whl" | cut -f1)
  if [ "$kernels" = yes ]; then
    echo "install_python.sh: wrote $whl ($size), with CUDA kernels"
  else
    echo "install_python.sh: wrote $whl ($size), without CUDA kernels (CPU tensors only)"
  fi
else
  kernels=$(cd /tmp && "$PYTHON" -c "import mala, torch
print('yes' if torch._C._dispatch_has_kernel_for_dispatch_key('mala::fwd', 'CUDA') else 'no')")
  version=$(cd /tmp && "$PYTHON" -c "import mala, torch; print('mala', mala.__version__, 'for torch', torch.__version__)")
  if [ "$kernels" = yes ]; then
    echo "install_python.sh: installed $version, with CUDA kernels"
  else
    echo "install_python.sh: installed $version, without CUDA kernels (CPU tensors only)"
  fi
fi
if [ $cpu = 0 ] && [ "$kernels" != yes ]; then
  if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.backends.cuda.is_built() else 1)"; then
    echo "install_python.sh: error: CUDA kernels were asked for, but this torch has no CUDA" \
         "(install a CUDA build of torch, or pass --cpu)" >&2
  else
    echo "install_python.sh: error: CUDA kernels were asked for and the build has none" >&2
  fi
  exit 1
fi
