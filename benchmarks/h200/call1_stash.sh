# Call 1 (carry BUNDLE/a): keep the first half of the bundle outside the repository.
# Also for a draft to keep training (carry BUNDLE/d, its parts from draft_parts.py pack):
#   PART=d DEST=init_parts bash benchmarks/h200/call1_stash.sh   # then INIT=init_parts for call 3
source benchmarks/h200/env.sh
mkdir -p "$W/${DEST:-}" && cp "$BUNDLE/${PART:-a}"/* "$W/${DEST:-}" && ls -la "$W/${DEST:-}"
nvidia-smi --query-gpu=name,memory.total --format=csv 2>/dev/null
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
