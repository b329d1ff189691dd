# Sourced by the studies' GPU drivers (lab/train/gpu_run.sh, lab/ar/gpu_run.sh): the `wait` half of
# a run started in the background with setsid.
#   bg_wait LIMIT PHASES_LOG STDOUT_LOG TAIL_LINES DIR...   waits up to LIMIT seconds or until
#     PHASES_LOG says "all done" or "build failed", then prints PHASES_LOG, the run's last stdout
#     lines, the tail of every other DIR/*.log (listed after the wait: logs appear as phases start)
#     and the GPU's utilization.
bg_wait() {
  local limit=$1 phases=$2 stdout=$3 n=$4 t0 f
  shift 4
  t0=$(date +%s)
  while ! grep -q "all done\|build failed" "$phases" 2>/dev/null && [ $(( $(date +%s) - t0 )) -lt "$limit" ]; do
    sleep 10
  done
  cat "$phases" 2>/dev/null || true
  tail -n 5 "$stdout" 2>/dev/null || true
  for f in $(for d in "$@"; do ls "$d"/*.log 2>/dev/null; done); do
    [ -f "$f" ] && [ "$f" != "$phases" ] || continue
    echo "== $(basename "$f")"
    tail -n "$n" "$f" | cut -c1-300
  done
  nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader 2>/dev/null || true
}
