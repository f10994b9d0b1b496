# Call 3, as often as needed (carry nothing): train in the background (it outlives the call while the
# machine stays warm), wait until it ends or DEADLINE seconds pass, and bring back the newest draft in
# parts (benchmarks/h200/draft_parts.py), so a lost machine costs only the steps since the last call.
#   DEADLINE=540 STEPS=5000 bash benchmarks/h200/call3_train.sh
# PACK=0 brings nothing back; it is the default when $OUT already holds a rewrite (chained right after
# call 2): the draft's parts and the rewrite together pass the 64 MiB a call brings back, and the rewrite
# is what a later session cannot remake cheaply.
# INIT=init_parts starts from the draft whose parts call 1 stashed in $W/init_parts (a fresh schedule);
# later calls on the same machine go on from it without INIT.
source benchmarks/h200/env.sh
DEADLINE=${DEADLINE:-540}
if [ -n "${INIT:-}" ] && [ ! -d "$W/init" ]; then
  { rm -rf "$W/init.tmp" && "$PY" benchmarks/h200/draft_parts.py unpack "$W/$INIT" "$W/init.tmp" \
    && mv "$W/init.tmp" "$W/init"; } || exit 1
fi
# every call, not only the first: --resume needs the options the run started with
[ -d "$W/init" ] && EXTRA_TRAIN="$EXTRA_TRAIN --init-draft $W/init"
training() { pgrep -f "eyas.cli train --prepared $W/prepared" > /dev/null; }
if ! training && ! grep -qs "draft saved" "$W/train.log"; then
  setsid nohup "$PY" -m eyas.cli train --prepared "$W/prepared" --online --model smollm2 --out "$W/train" \
    --max-steps "${STEPS:-5000}" --lr "${LR:-0.0005}" --save-every "${SAVE:-300}" --log-every 100 \
    --val-samples "${VAL:-200}" --val-every 1000 --num-workers 6 --resume $EXTRA_TRAIN >> "$W/train.log" 2>&1 &
  sleep 5
fi
while [ "$(elapsed)" -lt "$DEADLINE" ] && training; do sleep 10; done
grep -v Loading "$W/train.log" | tail -n 12
ls "$OUT"/regen*.xz.* > /dev/null 2>&1 && PACK=${PACK:-0}
[ "${PACK:-1}" = 0 ] || "$PY" benchmarks/h200/draft_parts.py pack "$W/train" "$OUT"
if room_for 2; then cp "$W/train/metrics.jsonl" "$OUT"/ 2>/dev/null; tail -c 60000 "$W/train.log" > "$OUT/train.log"; fi
echo "call 3 done after $(elapsed) s"
