# Sourced by each call*.sh (run from the repository root). W, outside the repository, is where the work
# lives between calls: on a lent machine it lasts only while the machine stays warm.
export W=${EYAS_WORK:-/root/w} REPO=$PWD BUNDLE=${BUNDLE:-.gpu} PY=${PY:-python3}
export OUT=${OUT:-$W/out}
mkdir -p "$W" "$OUT"
export PYTHONPATH=$W/site:$REPO PYTHONUNBUFFERED=1 EYAS_PROGRESS_EVERY=30 TOKENIZERS_PARALLELISM=false
export EYAS_SMOLLM2_GGUF=$W/SmolLM2-135M-Instruct.Q4_1.gguf EYAS_MTBENCH=$W/question.jsonl EYAS_CACHE=$W/cache
export TORCHINDUCTOR_CACHE_DIR=$W/inductor
eyas() { "$PY" -m eyas.cli "$@"; }
# DEADLINEs count from T0: the call's start when scripts are chained in one call
# (CALL_T0=$(date +%s); export CALL_T0; bash a.sh; bash b.sh), else the script's own start.
T0=${CALL_T0:-$(date +%s)}
elapsed() { echo $(( $(date +%s) - T0 )); }
# A call brings back at most 8 files from $OUT (alphabetically first when more): the extras (logs) go
# only where there is room, e.g. when call 3 runs chained after call 2 in one call.
room_for() { [ $(( $(ls "$OUT" | wc -l) + $1 )) -le 8 ]; }
