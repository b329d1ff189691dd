#!/usr/bin/env bash
# The multi-GPU context-parallel run (docs/distributed.md, "The multi-GPU run"): on a machine with
# G >= 2 GPUs and the mala package importable (PYTHONPATH), runs python/benchmarks/cp_timing.py
# under torchrun:
#   1. correctness against one GPU at 32K on G GPUs (outputs, gradients, realized slots);
#   2. speed and memory on G GPUs at each length of CP_SEQLENS (default 128K 256K 512K 1M): MALA at
#      tau = 0 and 1 and the dense ring (flash SDPA per chunk pair, the same schedule);
#   3. the same at CP_SEQLENS_2 (default 128K 512K) on 2 GPUs, when G > 2.
# Shape: B = 1, Hq = 8, Hkv = 1, d = 128, bf16, causal; the suite's synthetic workload (sharpness
# CP_SHARPNESS, default 16) unless CP_REGIME=random.  JSON and logs go to $OUT (or cp-logs/), then
# into one archive, cp_results.tar.xz.
#   bash lab/scripts/cp_multi_gpu.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
# NVLink multicast stays off (KINDS.md: a program using it can take the host's GPUs out of service).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out=${OUT:-cp-logs}
mkdir -p "$out/cp"
gpus=$(nvidia-smi --list-gpus | wc -l)
regime=${CP_REGIME:-synthetic}
sharp=${CP_SHARPNESS:-16}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/cp/device.txt"
nvidia-smi topo -m > "$out/cp/topo.txt" 2>&1
status=0
run() {  # run NPROC NAME ARGS...: one torchrun, its JSON and log under $out/cp
  local n=$1 name=$2
  shift 2
  echo "== $name ($n GPUs)"
  timeout "${CP_TIMEOUT:-300}" torchrun --standalone --nproc-per-node "$n" python/benchmarks/cp_timing.py \
    --regime "$regime" --sharpness "$sharp" --out "$out/cp/$name.json" "$@" >"$out/cp/$name.log" 2>&1
  local rc=$?
  [ $rc = 0 ] || { echo "$name: exit $rc"; tail -5 "$out/cp/$name.log"; status=1; }
}
run "$gpus" "check_32k_g$gpus" --seqlen 32768 --check --tau 0 1 --reps 3
for n in ${CP_SEQLENS:-131072 262144 524288 1048576}; do
  run "$gpus" "speed_${n}_g$gpus" --seqlen "$n" --tau 0 1 --dense-ring --reps "${CP_REPS:-3}"
done
if [ "$gpus" -gt 2 ]; then
  for n in ${CP_SEQLENS_2:-131072 524288}; do
    run 2 "speed_${n}_g2" --seqlen "$n" --tau 0 1 --dense-ring --reps "${CP_REPS:-3}"
  done
fi
tar cJf "$out/cp_results.tar.xz" -C "$out" cp
echo "cp_multi_gpu: $([ $status = 0 ] && echo PASS || echo FAIL)"
exit $status
