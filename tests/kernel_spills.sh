#!/usr/bin/env bash
# Register spills of the CUDA kernels against their budget (tests/kernel_spills.txt): fails when a
# kernel spills more bytes (stores + loads, the most over the architectures it is compiled for) than
# its line allows, or spills without a line.  A spill in a hot loop costs far more than its bytes
# suggest (a kernel whose loop state ptxas spilled ran 8-19% slower a layer on a real model); ptxas
# decides them from small, unrelated edits, so they are caught here, at compile time, on every build.
# Reads the ptxas messages that scripts/nvcc_log.sh keeps beside each object.
#   tests/kernel_spills.sh BUILD_DIR [BUDGET_FILE]
set -euo pipefail
build=$1
budget=${2:-$(dirname "$0")/kernel_spills.txt}
mapfile -t logs < <(find "$build" -name '*.ptxas.log' | sort)
if [ ${#logs[@]} -eq 0 ]; then
  echo "kernel_spills: no *.ptxas.log under $build (mala_cuda built without scripts/nvcc_log.sh?)" >&2
  exit 1
fi
cur=$(cat "${logs[@]}" |
  sed -nE "s/.*spilled to local memory in function '([^']*)', ([0-9]+) bytes spill stores, ([0-9]+) bytes spill loads.*/\1 \2 \3/p" |
  awk '{ b = $2 + $3; if (!($1 in m) || b > m[$1]) m[$1] = b } END { for (f in m) print f, m[f] }' | sort)
awk -v budget="$budget" '
  BEGIN { while ((getline line < budget) > 0) { if (line ~ /^#/ || line ~ /^[ \t]*$/) continue; split(line, w, " "); allow[w[2]] = w[1] } }
  { used[$1] = $2
    a = ($1 in allow) ? allow[$1] : 0
    if ($2 > a) { printf "kernel_spills: %s spills %d bytes (budget %d)\n", $1, $2, a; bad = 1 } }
  END {
    for (k in allow) if (!(k in used) || used[k] < allow[k])
      printf "kernel_spills: note: %s spills %d bytes, under its budget of %d (tighten it)\n", k, (k in used) ? used[k] : 0, allow[k]
    exit bad }' <<< "$cur"
echo "kernel_spills: $(printf '%s\n' "$cur" | grep -c . || true) spilling kernels, all within budget (${#logs[@]} objects)"
