# Call 1 (carry BUNDLE/a): keep the first half of the bundle outside the repository.
source benchmarks/h200/env.sh
cp "$BUNDLE"/a/* "$W"/ && ls -la "$W"
nvidia-smi --query-gpu=name,memory.total --format=csv 2>/dev/null
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
