#!/usr/bin/env bash
# Per-instruction stall sampling of the forward (or backward) kernels with Nsight Compute, on the GPU machine:
#   bash lab/scripts/ncu_fwd.sh BENCH_XZ_OR_BINARY [N]
#   MALA_NCU_OP=bwd bash lab/scripts/ncu_fwd.sh ...   the wgmma backward's main kernel instead (the
#                                                  benchmark's second launch of it, a timed one)
# Profiles one launch of the 128-key forward at tau = 0 and at tau = 1 (random inputs unless
# MALA_NCU_ARGS says otherwise, e.g. "--regime synthetic --sharpness 16"; the benchmark's third
# launch, its first timed one: the first computes the dense lse, the second records the tile mask)
# with the GPU's own clocks (--clock-control none, as the device notes ask), and writes, under $OUT,
# each report (.ncu-rep), its SASS with the sampled stall reasons per instruction (source page, CSV)
# and its details page (CSV).  bench/results/prof/fwd128_k128_ncu_stalls_random32k.txt (H100) and
# prof/fwd128_k128_ncu_warpvote_h200.txt (H200), both in commit 831db3a (docs/journal.md), summarize such runs of the 128-key forward by region of its loop.
set -uo pipefail
cd "$(dirname "$0")/../.."
bin=$1
n=${2:-32K}
out=${OUT:-ncu-logs}
mkdir -p "$out"
if [[ $bin == *.xz ]]; then xz -dc "$bin" > /tmp/ncu_bench && chmod +x /tmp/ncu_bench && bin=/tmp/ncu_bench; fi
ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $ncu"
[ -n "$ncu" ] || { echo "no ncu"; exit 1; }
op=${MALA_NCU_OP:-fwd}
kernel=sm90_k128
skip=2
[ "$op" = bwd ] && kernel=bwd_main_kernel_sm90 && skip=1
read -r -a extra <<< "${MALA_NCU_ARGS:---regime random}"
for tau in 0 1; do
  "$ncu" --kernel-name regex:$kernel --launch-skip $skip --launch-count 1 --set full --clock-control none --import-source no \
    -o "$out/${op}_tau$tau" -f "$bin" --op $op --n "$n" "${extra[@]}" --tau $tau --iters 2 > "$out/ncu_tau$tau.log" 2>&1
  tail -3 "$out/ncu_tau$tau.log"
  "$ncu" --import "$out/${op}_tau$tau.ncu-rep" --page source --csv --print-source sass > "$out/sass_tau$tau.csv" 2>&1
  "$ncu" --import "$out/${op}_tau$tau.ncu-rep" --page details --csv > "$out/details_tau$tau.csv" 2>&1
  wc -l "$out/sass_tau$tau.csv"
done
