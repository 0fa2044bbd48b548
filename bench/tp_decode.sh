#!/usr/bin/env bash
# Tensor-parallel inference on this machine (docs/parallelism.md): single-stream greedy
# generation through the engine with the same model at tp 1 (one process, both cores) and
# tp 2 (`mpirun -np 2`, one core per rank), in interleaved rounds: prefill seconds, decode
# tokens/s and per-token latency, and whether the tokens are identical.
# Usage: bench/tp_decode.sh [BUILD_DIR] [SHAPE=small] [TOKENS=64] [ROUNDS=3] [DTYPE=f32]
set -euo pipefail
BUILD=${1:-build}
SHAPE=${2:-small}
TOKENS=${3:-64}
ROUNDS=${4:-3}
DTYPE=${5:-f32}
TESSERA=$(realpath "$BUILD/bin/tessera")
W=$(mktemp -d /tmp/tessera_tp_decode.XXXX)
trap 'rm -rf "$W"' EXIT
MPIRUN=(mpirun --oversubscribe -np 2)
[ "$(id -u)" = 0 ] && MPIRUN=(mpirun --allow-run-as-root --oversubscribe -np 2)
"$BUILD/bin/random_model" "$W/model" "$SHAPE" 1
PROMPT=$(seq -s, 11 43)  # 33 prompt tokens
gen() {  # tp -> "prefill_s decode_tok_s tokens"
  local out
  if [ "$1" = 1 ]; then
    OMP_NUM_THREADS=2 "$TESSERA" generate --model "$W/model" --prompt-ids "$PROMPT" \
      --max-tokens "$TOKENS" --dtype "$DTYPE" > "$W/stdout" 2> "$W/stderr"
  else
    OMP_NUM_THREADS=1 "${MPIRUN[@]}" "$TESSERA" generate --model "$W/model" --prompt-ids "$PROMPT" \
      --max-tokens "$TOKENS" --dtype "$DTYPE" --tp 2 > "$W/stdout" 2> "$W/stderr"
  fi
  out=$(cat "$W/stderr")
  local tokens prefill dps
  tokens=$(grep -E '^[0-9]+(,[0-9]+)*$' "$W/stdout" | head -1)
  prefill=$(echo "$out" | sed -n 's/.*prefill [0-9]* tokens in \([0-9.]*\) s.*/\1/p')
  dps=$(echo "$out" | sed -n 's/.*decode \([0-9.]*\) tokens\/s.*/\1/p')
  echo "$prefill $dps $tokens"
}
for r in $(seq 1 "$ROUNDS"); do
  echo "tp1 $(gen 1)" >> "$W/results"
  echo "tp2 $(gen 2)" >> "$W/results"
done
python3 - "$W/results" "$SHAPE" "$DTYPE" <<'PY'
import json, statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
out = {"shape": sys.argv[2], "dtype": sys.argv[3]}
tokens = {}
for tp in ("tp1", "tp2"):
    rs = [r for r in rows if r[0] == tp]
    dps = statistics.median(float(r[2]) for r in rs)
    out[tp] = {"prefill_s": round(statistics.median(float(r[1]) for r in rs), 4),
               "decode_tokens_per_s": round(dps, 2),
               "ms_per_token": round(1000 / dps, 2)}
    tokens[tp] = {r[3] for r in rs}
out["tp2_over_tp1_decode"] = round(out["tp2"]["decode_tokens_per_s"] / out["tp1"]["decode_tokens_per_s"], 3)
out["tokens_identical"] = tokens["tp1"] == tokens["tp2"] and len(tokens["tp1"]) == 1
print(json.dumps(out, indent=1))
PY
