# Call 2 (carry BUNDLE/b): assemble the target, compile the trainer in the background (the real run's
# shapes), rewrite ShareGPT with the target (greedy) until DEADLINE seconds into the call, prepare it.
# Run it again to resume an unfinished rewrite.   DEADLINE=540 SAMPLES=0 bash benchmarks/h200/call2_regen.sh
source benchmarks/h200/env.sh
T0=$(date +%s); DEADLINE=${DEADLINE:-540}; SAMPLES=${SAMPLES:-0}
if [ ! -f "$EYAS_SMOLLM2_GGUF" ]; then
  cp "$BUNDLE"/b/*.whl "$W"/ && "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$W/site" "$W"/*.whl
  cat "$W/gguf.part00" "$BUNDLE/b/gguf.part01" > "$EYAS_SMOLLM2_GGUF" && rm "$W/gguf.part00"
fi
[ -f "$W/users.jsonl" ] || xz -dc "$W/sharegpt_users.jsonl.xz" > "$W/users.jsonl"
"$PY" -c "from eyas.assets import smollm2_dir; print(smollm2_dir())" || exit 1
if [ ! -d "$W/warm" ] && [ -z "${NO_WARMUP:-}" ]; then  # placeholder replies: only the shapes matter
  eyas prepare "$W/users.jsonl" --max-samples 400 --out "$W/warm_prep" --max-length 2048 > "$W/warm.log" 2>&1
  setsid nohup "$PY" -m eyas.cli train --prepared "$W/warm_prep" --online --model smollm2 --out "$W/warm" \
    --max-steps 4 --max-time 0.001 --lr 0.0005 $EXTRA_TRAIN >> "$W/warm.log" 2>&1 &
fi
echo "set up after $(elapsed) s"
BUDGET=$(( DEADLINE - 40 - $(elapsed) )); [ "$BUDGET" -ge 1 ] || BUDGET=1  # 40 s left for prepare
eyas regenerate -i "$W/users.jsonl" --out "$W/regen.jsonl" --max-samples "$SAMPLES" --engine "${ENGINE:-static}" \
  --max-new-tokens 256 --max-length 2048 --temperature 0 --max-time "$BUDGET" > "$W/regen.log" 2>&1
tail -n 3 "$W/regen.log"
if grep -q '"complete": true' "$W/regen.jsonl.manifest.json"; then
  eyas prepare "$W/regen.jsonl" --out "$W/prepared" --max-length 2048 --num-workers "${WORKERS:-12}" 2>&1 | tail -n 8
fi
cp "$W/regen.log" "$W/regen.jsonl.manifest.json" "$OUT"/ 2>/dev/null
echo "call 2 done after $(elapsed) s"
