# Sourced by each call*.sh (run from the repository root). W, outside the repository, is where the work
# lives between calls: on a lent machine it lasts only while the machine stays warm.
export W=${EYAS_WORK:-/root/w} REPO=$PWD BUNDLE=${BUNDLE:-.gpu} PY=${PY:-python3}
export OUT=${OUT:-$W/out}
mkdir -p "$W" "$OUT"
export PYTHONPATH=$W/site:$REPO PYTHONUNBUFFERED=1 EYAS_PROGRESS_EVERY=30 TOKENIZERS_PARALLELISM=false
export EYAS_SMOLLM2_GGUF=$W/SmolLM2-135M-Instruct.Q4_1.gguf EYAS_MTBENCH=$W/question.jsonl EYAS_CACHE=$W/cache
export TORCHINDUCTOR_CACHE_DIR=$W/inductor
eyas() { "$PY" -m eyas.cli "$@"; }
elapsed() { echo $(( $(date +%s) - T0 )); }
