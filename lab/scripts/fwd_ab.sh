#!/usr/bin/env bash
# A/B of forward-kernel variants on the GPU machine, in one call: every benchmark binary staged in
# .carry/ab/ (xz-compressed, NAME.xz; each a mala_bench built here, e.g. a variant selected by a
# -D macro in CMAKE_CUDA_FLAGS) runs the same benchmark (the forward by default; any mala_bench
# flags, --op bwd too), the binaries alternating within each round so that clock drift does not
# favour one of them.  Stage here:
#   mkdir -p .carry/ab && xz -T2 -c build-x/bench/mala_bench > .carry/ab/x.xz
# then on the GPU machine (device tool, carry [".carry/ab"]):
#   bash lab/scripts/fwd_ab.sh [ROUNDS] [mala_bench flags...]
# Logs go to $OUT (or ab-logs/); the last lines printed are the table of every binary's forward rows
# (backward rows, whose N is not the first column, are in ab.log under each "== round" line).
# Each binary runs alone and its taus one after the other: under --interleave two builds' identical
# dense instances once read 6-8% apart (docs/journal.md), so pass it only to compare
# the taus of one build.
set -uo pipefail
cd "$(dirname "$0")/../.."
rounds=${1:-2}
shift || true
args=("$@")
[ ${#args[@]} -eq 0 ] && args=(--op fwd --n 128K --regime random,synthetic --sharpness 4,16 --tau 0,1 --iters 10)
out=${OUT:-ab-logs}
mkdir -p "$out" /tmp/ab
for f in .carry/ab/*.xz; do
  name=$(basename "$f" .xz)
  xz -dc "$f" > "/tmp/ab/$name" && chmod +x "/tmp/ab/$name"
done
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv,noheader | tee "$out/device.txt"
bins=(/tmp/ab/*)
for r in $(seq 1 "$rounds"); do
  # Odd rounds in name order, even rounds reversed: a binary's place in the round (the GPU warms
  # up along it) favours none of them over an even number of rounds.
  order=("${bins[@]}")
  if [ $((r % 2)) -eq 0 ]; then
    order=()
    for ((i = ${#bins[@]} - 1; i >= 0; --i)); do order+=("${bins[$i]}"); done
  fi
  for b in "${order[@]}"; do
    name=$(basename "$b")
    echo "== round $r: $name ${args[*]}" >> "$out/ab.log"
    "$b" "${args[@]}" >> "$out/ab.log" 2>&1 || echo "$name failed (exit $?)" | tee -a "$out/ab.log"
  done
done
# The table: each binary's rows, tagged with the binary and round.
awk '/^== round/ {tag = $3 " " $4} /^ *[0-9]+K / {print tag, $0}' "$out/ab.log" | tee "$out/ab_table.txt"
