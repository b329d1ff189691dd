#!/usr/bin/env bash
# Installs the `mala` Python package into the current Python environment, built against the torch
# already installed there (one command; docs/python.md):
#   bash scripts/install_python.sh                 GPU kernels when nvcc is found, else a CPU-only build
#   bash scripts/install_python.sh --cpu           CPU-only build (the exact CPU implementation)
#   bash scripts/install_python.sh --wheel DIR     build a wheel into DIR instead of installing it
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
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
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
if [ $cpu = 1 ]; then
  export CMAKE_ARGS="-DMALA_CUDA=OFF ${CMAKE_ARGS:-}"
else
  archs=${MALA_CUDA_ARCHS:-$("$PYTHON" -c "import torch
if torch.cuda.is_available():
    major, minor = torch.cuda.get_device_capability()
    print(f'{major}{minor}' + ('a' if major == 9 else ''))
else:
    print('80;90a')")}
  export CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=$archs ${CMAKE_ARGS:-}"
fi
export CMAKE_BUILD_PARALLEL_LEVEL=${JOBS:-$(nproc)}
echo "install_python.sh: CMAKE_ARGS=$CMAKE_ARGS, $CMAKE_BUILD_PARALLEL_LEVEL jobs (compiler output follows)"
if [ -n "$wheel" ]; then
  "$PYTHON" -m pip wheel --no-build-isolation --no-deps -v -w "$wheel" .
else
  "$PYTHON" -m pip install --no-build-isolation --no-deps -v .
fi
if [ -z "$wheel" ]; then
  (cd /tmp && "$PYTHON" -c "import mala, torch; print('install_python.sh: mala', mala.__version__, 'installed for torch', torch.__version__)")
fi
