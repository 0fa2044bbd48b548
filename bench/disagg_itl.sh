#!/usr/bin/env bash
# Prefill/decode disaggregation under a mixed load (docs/performance.md): the same requests
# (`bench serve --url` with a prompt-length mix, Poisson arrivals) against
#   (a) colocated: one `tessera serve` on both cores (taskset -c 0,1, OMP_NUM_THREADS=2), and
#   (b) disaggregated: `tessera router` + one `--role prefill` worker on core 0 and one
#       `--role decode` worker on core 1 (OMP_NUM_THREADS=1 each),
# alternating ROUNDS times. Prints decode ITL p50/p99, TTFT, throughput and (b)'s KV transfer
# time per round, then the medians and the ITL p99 ratio (b)/(a).
# Usage: bench/disagg_itl.sh [BIN] [ROUNDS]; env SHAPE, MIX, OUT, RATE, N, TRANSPORT override.
set -euo pipefail
BIN=${1:-build/bin/tessera}
ROUNDS=${2:-3}
SHAPE=${SHAPE:-small}
MIX=${MIX:-32:0.5,1024:0.5}
OUT=${OUT:-128}
RATE=${RATE:-0.25}
N=${N:-16}
TRANSPORT=${TRANSPORT:-tcp}
# A 1024-token prefill on a busy core can take longer than /health's default 10 s budget.
ENGINE="--shape $SHAPE --kv-cache-memory 1500000000 --health-timeout 120"
export OMP_WAIT_POLICY=PASSIVE
DIR=$(mktemp -d)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$DIR"; }
trap cleanup EXIT

start() {  # start NAME CPUS THREADS ARGS...: waits for "listening on", sets URL
  local name=$1 cpus=$2 threads=$3; shift 3
  : >"$DIR/$name.log"
  OMP_NUM_THREADS=$threads taskset -c "$cpus" "$BIN" "$@" --port 0 2>"$DIR/$name.log" &
  PIDS+=($!)
  for _ in $(seq 300); do grep -q "listening on" "$DIR/$name.log" && break; sleep 0.2; done
  URL=$(grep -o "listening on http://[0-9.]*:[0-9]*" "$DIR/$name.log" | grep -o "http://.*")
}
stop_all() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; PIDS=(); }
run_bench() {  # run_bench URL -> one JSON line
  "$BIN" bench serve --url "$1" --num-requests "$N" --prompt-len-mix "$MIX" --output-len "$OUT" \
    --request-rate "$RATE" --seed 7 --json 2>"$DIR/bench.err" | tail -1 || true
}
summary() {  # summary JSON [KV_SECONDS_MEAN]
  python3 -c '
import json, sys
r = json.loads(sys.argv[1]); kv = sys.argv[2]
for f in r.get("failures", [])[:3]: print("  failure:", f[:300])
print("itl p50 %.1f ms p99 %.1f ms | ttft p50 %.0f ms p99 %.0f ms | %.1f output tok/s | %d ok %d failed%s" % (
  r["itl_s"]["p50"]*1e3, r["itl_s"]["p99"]*1e3, r["ttft_s"]["p50"]*1e3, r["ttft_s"]["p99"]*1e3,
  r["output_tokens_per_s"], r["completed"], r["failed"], kv))' "$1" "${2:-}"
}
kv_mean() {  # mean KV transfer seconds from the router's /metrics
  curl -s "$1/metrics" | python3 -c '
import sys
s = c = 0.0
for line in sys.stdin:
  if line.startswith("tessera_router_kv_transfer_seconds_sum"): s = float(line.split()[-1])
  if line.startswith("tessera_router_kv_transfer_seconds_count"): c = float(line.split()[-1])
print(" | kv transfer mean %.2f ms over %d requests" % (1e3 * s / c if c else 0, c))'
}

echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "load: $N requests, prompt mix $MIX, $OUT output tokens, $RATE requests/s (Poisson), model $SHAPE, transport $TRANSPORT"
A=(); B=()
for r in $(seq "$ROUNDS"); do
  start colo 0,1 2 serve $ENGINE
  ja=$(run_bench "$URL")
  stop_all
  echo "round $r (a) colocated, 2 cores:      $(summary "$ja")"
  A+=("$ja")
  start prefill 0 1 serve $ENGINE --role prefill
  P=$URL
  start decode 1 1 serve $ENGINE --role decode --kv-transport "$TRANSPORT"
  D=$URL
  start router 0,1 1 router --prefill "$P" --decode "$D" --kv-transport "$TRANSPORT"
  jb=$(run_bench "$URL")
  kv=$(kv_mean "$URL")
  stop_all
  echo "round $r (b) 1 prefill + 1 decode:   $(summary "$jb" "$kv")"
  B+=("$jb")
done
python3 - "${#A[@]}" "${A[@]}" "${B[@]}" <<'PY'
import json, statistics, sys
n = int(sys.argv[1]); A = [json.loads(x) for x in sys.argv[2:2+n]]; B = [json.loads(x) for x in sys.argv[2+n:]]
med = lambda rs, f: statistics.median(f(r) for r in rs)
for name, rs in (("(a) colocated", A), ("(b) disaggregated", B)):
  print("median %-18s itl p50 %.1f ms, itl p99 %.1f ms, ttft p50 %.0f ms, ttft p99 %.0f ms, %.1f output tok/s" % (name,
    med(rs, lambda r: r["itl_s"]["p50"]*1e3), med(rs, lambda r: r["itl_s"]["p99"]*1e3),
    med(rs, lambda r: r["ttft_s"]["p50"]*1e3), med(rs, lambda r: r["ttft_s"]["p99"]*1e3),
    med(rs, lambda r: r["output_tokens_per_s"])))
ratios = [b["itl_s"]["p99"] / a["itl_s"]["p99"] for a, b in zip(A, B)]
print("itl p99 (b)/(a) per round:", " ".join("%.2f" % x for x in ratios), "median %.2f" % statistics.median(ratios),
      "(the bar: <= 0.5)")
PY
