# Call 2 (carry BUNDLE/b): assemble the target, compile the trainer in the background (the real run's
# shapes), rewrite ShareGPT with the target (greedy) until DEADLINE seconds into the call, prepare it.
# Run it again to resume an unfinished rewrite.   DEADLINE=540 SAMPLES=0 bash benchmarks/h200/call2_regen.sh
# Each call brings the rewrite back in $OUT (xz, 15 MB parts: finished batches while cut, the file once
# complete); put those files in BUNDLE/c (git-ignored: kept only as long as this checkout is; the
# rewrite's parts replace the partial ones) and carry it too, and the next machine resumes from them.
# A second, sampled rewrite afterwards (one at a time: two decoders sharing the GPU are slower), then
# prepare every rewrite there is, finished or cut:   TEMP=0.8 SEED=1 PREPARE=1 DEADLINE=300 bash ...
# PREP_ARGS adds options to that prepare, e.g. PREP_ARGS="--trim-loops 32".
source benchmarks/h200/env.sh
DEADLINE=${DEADLINE:-540}; SAMPLES=${SAMPLES:-0}; TEMP=${TEMP:-0}; SEED=${SEED:-0}
NAME=regen; [ "$TEMP" = 0 ] || NAME=regen_t${TEMP}_s${SEED}
complete() { grep -qs '"complete": true' "$W/$NAME.jsonl.manifest.json"; }
if [ ! -f "$EYAS_SMOLLM2_GGUF" ]; then
  cp "$BUNDLE"/b/*.whl "$W"/ && "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$W/site" "$W"/*.whl
  cat "$W/gguf.part00" "$BUNDLE/b/gguf.part01" > "$EYAS_SMOLLM2_GGUF" && rm "$W/gguf.part00"
fi
[ -f "$W/users.jsonl" ] || xz -dc "$W/sharegpt_users.jsonl.xz" > "$W/users.jsonl"
"$PY" -c "from eyas.assets import smollm2_dir; print(smollm2_dir())" || exit 1
if [ ! -d "$W/warm" ] && [ -z "${NO_WARMUP:-}" ]; then  # placeholder replies: only the shapes matter
  timeout 120 "$PY" -m eyas.cli prepare "$W/users.jsonl" --max-samples 400 --out "$W/warm_prep" --max-length 2048 \
    > "$W/warm.log" 2>&1  # a bound, as the device time is: this once hung a whole call (since fixed)
  setsid nohup "$PY" -m eyas.cli train --prepared "$W/warm_prep" --online --model smollm2 --out "$W/warm" \
    --max-steps 4 --max-time 0.001 --lr 0.0005 $EXTRA_TRAIN >> "$W/warm.log" 2>&1 &
fi
if [ ! -f "$W/$NAME.jsonl.partial" ] && ls "$BUNDLE"/c/$NAME.partial.xz.* > /dev/null 2>&1; then
  cat "$BUNDLE"/c/$NAME.partial.xz.* | xz -dc > "$W/$NAME.jsonl.partial"  # resumed by regenerate
fi
if [ ! -f "$W/$NAME.jsonl" ] && ls "$BUNDLE"/c/$NAME.jsonl.xz.* > /dev/null 2>&1; then
  cat "$BUNDLE"/c/$NAME.jsonl.xz.* | xz -dc > "$W/$NAME.jsonl"  # with its manifest: up to date, reused
  cp "$BUNDLE/c/$NAME.jsonl.manifest.json" "$W"/
fi
echo "set up after $(elapsed) s"
BUDGET=$(( DEADLINE - 60 - $(elapsed) )); [ "$BUDGET" -ge 1 ] || BUDGET=1  # 60 s left for prepare and xz
eyas regenerate -i "$W/users.jsonl" --out "$W/$NAME.jsonl" --max-samples "$SAMPLES" --generator "${GENERATOR:-static}" \
  --max-new-tokens 256 --max-length 2048 --temperature "$TEMP" --seed "$SEED" --max-time "$BUDGET" \
  > "$W/$NAME.log" 2>&1
tail -n 3 "$W/$NAME.log"
if [ -n "${PREPARE:-}" ] || complete; then
  eyas prepare "$W"/regen*.jsonl --out "$W/prepared" --max-length 2048 --num-workers "${WORKERS:-12}" \
    $PREP_ARGS 2>&1 | tail -n 9
fi
cp "$W/$NAME.jsonl.manifest.json" "$OUT"/ 2>/dev/null  # the log's last lines are printed above
if complete; then  # unless it was carried in complete: then there is nothing new to bring back
  [ -f "$BUNDLE/c/$NAME.jsonl.xz.00" ] || xz -T0 -c "$W/$NAME.jsonl" | split -b 15M -d - "$OUT/$NAME.jsonl.xz."
elif [ -f "$W/$NAME.jsonl.partial" ]; then
  xz -T0 -c "$W/$NAME.jsonl.partial" | split -b 15M -d - "$OUT/$NAME.partial.xz."
fi
ls -la "$OUT"
echo "call 2 done after $(elapsed) s"
