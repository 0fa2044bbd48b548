#!/usr/bin/env bash
# The HTTP layer's cost: `bench serve --url` against `tessera serve --shape S` versus the
# offline engine (`bench serve --shape S`) on the same requests (same seed and lengths),
# alternating ROUNDS times; prints each pair and the median ratio. Then the inter-token
# latency spread at 8 concurrent streams (p99 / p50).
# Usage: bench/serve_http_vs_offline.sh [BIN] [SHAPE] [ROUNDS]
set -euo pipefail
BIN=${1:-build/bin/tessera}
SHAPE=${2:-small}
ROUNDS=${3:-3}
export OMP_WAIT_POLICY=PASSIVE
LOG=$(mktemp)
"$BIN" serve --shape "$SHAPE" --port 0 --max-num-batched-tokens "${TOKENS:-2048}" 2>"$LOG" &
PID=$!
trap 'kill $PID 2>/dev/null; rm -f "$LOG"' EXIT
for _ in $(seq 100); do grep -q "listening on" "$LOG" && break; sleep 0.2; done
URL=$(grep -o "http://[0-9.]*:[0-9]*" "$LOG")
REQ="--num-requests 32 --prompt-len 128 --output-len 128 --seed 0"
ratios=()
for r in $(seq "$ROUNDS"); do
  off=$("$BIN" bench serve --shape "$SHAPE" $REQ --baseline-requests 0 --json 2>/dev/null | tail -1 |
        python3 -c 'import json,sys; print(json.load(sys.stdin)["main"]["total_tokens_per_s"])')
  http=$("$BIN" bench serve --url "$URL" $REQ --max-concurrency 32 --json 2>/dev/null | tail -1 |
         python3 -c 'import json,sys; print(json.load(sys.stdin)["total_tokens_per_s"])')
  ratio=$(python3 -c "print(f'{$http / $off:.3f}')")
  ratios+=("$ratio")
  echo "round $r: offline $off tok/s, http $http tok/s, http/offline $ratio"
done
python3 -c "import statistics,sys; print('median http/offline:', statistics.median(map(float, sys.argv[1:])))" "${ratios[@]}"
kill $PID; wait $PID 2>/dev/null || true
# ITL spread at 8 concurrent streams; a small per-step token budget keeps prefills from
# stalling the decodes (chunked prefill), as a latency-minded deployment would run.
"$BIN" serve --shape "$SHAPE" --port 0 --max-num-batched-tokens "${ITL_TOKENS:-32}" 2>"$LOG" &
PID=$!
for _ in $(seq 100); do grep -q "listening on" "$LOG" && break; sleep 0.2; done
URL=$(grep -o "http://[0-9.]*:[0-9]*" "$LOG")
"$BIN" bench serve --url "$URL" --num-requests 32 --prompt-len 128 --output-len 128 --max-concurrency 8 --json \
  2>/dev/null | tail -1 | python3 -c '
import json, sys
r = json.load(sys.stdin)
itl = {k: v * 1000 for k, v in r["itl_s"].items()}
print("8 streams: itl p50 %.1f ms, p99 %.1f ms, p99/p50 %.2f; output %.1f tok/s" %
      (itl["p50"], itl["p99"], itl["p99"] / itl["p50"], r["output_tokens_per_s"]))'
