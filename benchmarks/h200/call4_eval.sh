# Call 4, optional (carry nothing): MT-Bench on the GPU in float32 (exact, unlike bf16) with the finished
# draft, until DEADLINE seconds; the report comes back, or, when cut, the generations measured so far
# (eval.partial.jsonl: one record per generation, with its acceptance histogram). Resumable: run it again.
#   DEADLINE=540 PROMPTS=20 bash benchmarks/h200/call4_eval.sh
source benchmarks/h200/env.sh
DEADLINE=${DEADLINE:-540}
timeout $(( DEADLINE - 20 )) "$PY" -m eyas.cli eval --model smollm2 --draft "$W/train/draft" --prompts mtbench \
  --temperature 0 --max-prompts "${PROMPTS:-20}" --max-new-tokens "${NEW:-192}" --chain 7 --tree 60:7:10 --no-baseline \
  --dtype float32 --out "$W/eval" > "$W/eval.log" 2>&1
tail -n 20 "$W/eval.log"
cp "$W"/eval/*.json "$W"/eval/*.md "$W"/eval/*.png "$W"/eval.partial.jsonl "$OUT"/ 2>/dev/null; tail -c 60000 "$W/eval.log" > "$OUT/eval.log"
echo "call 4 done after $(elapsed) s"
