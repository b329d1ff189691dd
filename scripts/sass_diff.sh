#!/usr/bin/env bash
# Compares the SASS (sm_90a) of every kernel in some CUDA sources at two revisions, kernel by
# kernel, instruction by instruction (addresses and encodings dropped): "same" means ptxas produced
# the same code, so timings of one revision hold for the other.  Also prints each kernel's spills and
# its R2UR count (wgmma descriptors built outside the uniform registers show up there).
#   scripts/sass_diff.sh REV_A REV_B [FILE ...]   FILE: under src/cuda/ (default
#                                                  instantiations/bwd_bf16_d128.cu; bwd/dispatch.cu
#                                                  holds the row-wise kernels); REV_B may be WORKTREE
#                                                  (the working tree as it is)
# Needs nvcc here and cuobjdump / nvdisasm, which CUDA installs without nvcc's own bin/ may lack:
# they come from NVIDIA's PyPI wheels, pinned below, into $SASS_TOOLS (default .sass-tools/).
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { echo "usage: scripts/sass_diff.sh REV_A REV_B [FILE ...]" >&2; exit 2; }
rev_a=$1 rev_b=$2
shift 2
files=("$@")
[ ${#files[@]} -gt 0 ] || files=(instantiations/bwd_bf16_d128.cu)
TOOLS=${SASS_TOOLS:-$PWD/.sass-tools}
if [ ! -x "$TOOLS/nvidia/cu13/bin/nvdisasm" ] || [ ! -x "$TOOLS/nvidia/cu13/bin/cuobjdump" ]; then
  python3 -m pip install -q --no-deps --target "$TOOLS" nvidia-cuda-cuobjdump==13.5.37 nvidia-cuda-nvdisasm==13.5.37
  chmod +x "$TOOLS"/nvidia/cu13/bin/*
fi
export PATH=$TOOLS/nvidia/cu13/bin:$PATH
work=$(mktemp -d /tmp/sass_diff.XXXXXX)
trap 'rm -rf "$work"' EXIT
tree() {  # rev dir: the sources at rev (WORKTREE: as they are here)
  mkdir -p "$2"
  if [ "$1" = WORKTREE ]; then cp -r include src "$2/"; else git archive "$1" include src | tar -x -C "$2"; fi
}
tree "$rev_a" "$work/a"
tree "$rev_b" "$work/b"
for path in "${files[@]}"; do
  f=${path//\//_}
  for side in a b; do
    (nvcc -O3 -DNDEBUG -arch=sm_90a -cubin --use_fast_math -lineinfo --expt-relaxed-constexpr -std=c++17 \
       -Xptxas=-warn-spills -I "$work/$side/include" -I "$work/$side/src" \
       -o "$work/$side.$f.cubin" "$work/$side/src/cuda/$path" 2> "$work/$side.$f.log" ||
     { cat "$work/$side.$f.log" >&2; exit 1; }) &
  done
  wait
  mapfile -t kernels < <(for side in a b; do cuobjdump -sass "$work/$side.$f.cubin"; done |
                         sed -nE 's/^\s+Function : (\S+)/\1/p' | sort -u)
  echo "== $path ($rev_a vs $rev_b)"
  for k in "${kernels[@]}"; do
    for side in a b; do
      cuobjdump -sass -fun "$k" "$work/$side.$f.cubin" 2>/dev/null |
        sed -nE 's/^\s+\/\*[0-9a-f]+\*\/\s+([^;]*;).*/\1/p' > "$work/$side.sass"
    done
    na=$(wc -l < "$work/a.sass") nb=$(wc -l < "$work/b.sass")
    if [ "$na" -eq 0 ] || [ "$nb" -eq 0 ]; then verdict="only in $([ "$na" -eq 0 ] && echo "$rev_b" || echo "$rev_a")"
    elif cmp -s "$work/a.sass" "$work/b.sass"; then verdict=same
    else verdict="differ ($(diff "$work/a.sass" "$work/b.sass" | grep -c '^[<>]' || true) lines)"; fi
    spill() { sed -nE "s/.*in function '$k', ([0-9]+) bytes spill stores, ([0-9]+) bytes spill loads.*/ \1+\2 B spilled/p" "$work/$1.$f.log"; }
    # R2UR: a value moved from a regular to a uniform register, before every wgmma whose descriptor
    # ptxas built in regular registers (a loop that lost its uniform slot index shows dozens more).
    ra=$(grep -c 'R2UR' "$work/a.sass" || true) rb=$(grep -c 'R2UR' "$work/b.sass" || true)
    printf '  %-8s %5d / %5d instr %4d / %4d R2UR%s |%s  %s\n' "${verdict%% *}" "$na" "$nb" "$ra" "$rb" \
      "$(spill a)" "$(spill b)" "$k"
  done
done
