#!/usr/bin/env bash
# Data-parallel scaling on this machine: tokens/s of one process (all cores) against
# `mpirun -np 2` (one core each), the share of all-reduce time hidden behind backward
# (from --trace), and ZeRO-3 step time with and without prefetch. Same model, same global
# batch in every run. Usage: bench/dp_scaling.sh [BUILD_DIR] [STEPS]
set -euo pipefail
BUILD=${1:-build}
STEPS=${2:-30}
TESSERA=$(realpath "$BUILD/bin/tessera")
HERE=$(cd "$(dirname "$0")" && pwd)
W=$(mktemp -d /tmp/tessera_dp_scaling.XXXX)
trap 'rm -rf "$W"' EXIT
MPIRUN=(mpirun --oversubscribe -np 2)
[ "$(id -u)" = 0 ] && MPIRUN=(mpirun --allow-run-as-root --oversubscribe -np 2)

cat /usr/share/games/fortunes/*.u8 2>/dev/null > "$W/corpus.txt" || cat /usr/share/games/fortunes/* > "$W/corpus.txt"
"$TESSERA" tokenizer train --input "$W/corpus.txt" --vocab-size 2048 --out "$W/tok" > /dev/null 2>&1
"$TESSERA" data prepare --tokenizer "$W/tok" --input "$W/corpus.txt" --out "$W/data" > /dev/null 2>&1

config() {  # out_dir zero_stage prefetch
  cat <<CFG
[run]
out_dir = "$1"
[model]
shape = "small"
hidden_size = 256
num_layers = 6
num_heads = 8
num_kv_heads = 4
intermediate_size = 768
[data]
dir = "$W/data"
seq_len = 128
batch_size = 8
[training]
steps = $STEPS
precision = "bf16"
eval_batches = 0
[logging]
progress = false
peak_gflops = 100.0
plot = false
[parallel]
zero_stage = $2
prefetch = $3
bucket_mb = 2
CFG
}

median_tps() {  # metrics.jsonl -> median tokens/s over steps after the first 5
  python3 -c "
import json,statistics,sys
v=[json.loads(l)['tokens_per_s'] for l in open('$1') if '\"loss\"' in l][5:]
print('%.0f' % statistics.median(v))"
}

run1() { config "$W/dp1" 0 true > "$W/dp1.toml"; OMP_NUM_THREADS=2 "$TESSERA" train --config "$W/dp1.toml" > /dev/null 2>&1; }
run2() {  # name stage prefetch [trace]
  config "$W/$1" "$2" "$3" > "$W/$1.toml"
  OMP_NUM_THREADS=1 "${MPIRUN[@]}" "$TESSERA" train --config "$W/$1.toml" ${4:+--trace "$4"} > /dev/null 2>&1
}

run1
run2 dp2 0 true "$W/dp2_trace.json"
run2 z3_prefetch 3 true
run2 z3_noprefetch 3 false
echo "{\"dp1_tokens_per_s\": $(median_tps "$W/dp1/metrics.jsonl"), \
\"dp2_tokens_per_s\": $(median_tps "$W/dp2/metrics.jsonl"), \
\"zero3_prefetch_tokens_per_s\": $(median_tps "$W/z3_prefetch/metrics.jsonl"), \
\"zero3_no_prefetch_tokens_per_s\": $(median_tps "$W/z3_noprefetch/metrics.jsonl"), \
\"dp2_overlap\": $(python3 "$HERE/trace_overlap.py" "$W/dp2_trace.rank0.json" --skip-steps 5)}"
