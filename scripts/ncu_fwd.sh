#!/usr/bin/env bash
# Per-instruction stall sampling of the forward (or backward) kernels with Nsight Compute, on the GPU machine:
#   bash scripts/ncu_fwd.sh BENCH_XZ_OR_BINARY [N]
#   MALA_NCU_OP=bwd bash scripts/ncu_fwd.sh ...   the wgmma backward's main kernel instead (the
#                                                  benchmark's second launch of it, a timed one)
# Profiles one launch of the warp-specialized forward at tau = 0 and at tau = 1 (random inputs; the
# benchmark's second launch of it, its untimed run that records the tile mask, so the kRecord
# instance, which ncu names; the timed runs use the other one) and writes, under $OUT,
# each report (.ncu-rep), its SASS with the sampled stall reasons per instruction (source page, CSV)
# and its details page (CSV).  bench/results/mala_fwd_ncu_h100_tau.txt is a summary of two such runs.
set -uo pipefail
cd "$(dirname "$0")/.."
bin=$1
n=${2:-32K}
out=${OUT:-ncu-logs}
mkdir -p "$out"
if [[ $bin == *.xz ]]; then xz -dc "$bin" > /tmp/ncu_bench && chmod +x /tmp/ncu_bench && bin=/tmp/ncu_bench; fi
ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $ncu"
[ -n "$ncu" ] || { echo "no ncu"; exit 1; }
op=${MALA_NCU_OP:-fwd}
kernel=sm90_ws
[ "$op" = bwd ] && kernel=bwd_main_kernel_sm90
for tau in 0 1; do
  "$ncu" --kernel-name regex:$kernel --launch-skip 1 --launch-count 1 --set full --import-source no \
    -o "$out/${op}_tau$tau" -f "$bin" --op $op --n "$n" --regime random --tau $tau --iters 2 > "$out/ncu_tau$tau.log" 2>&1
  tail -3 "$out/ncu_tau$tau.log"
  "$ncu" --import "$out/${op}_tau$tau.ncu-rep" --page source --csv --print-source sass > "$out/sass_tau$tau.csv" 2>&1
  "$ncu" --import "$out/${op}_tau$tau.ncu-rep" --page details --csv > "$out/details_tau$tau.csv" 2>&1
  wc -l "$out/sass_tau$tau.csv"
done
