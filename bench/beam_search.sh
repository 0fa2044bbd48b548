#!/usr/bin/env bash
# Beam search against parallel sampling on the same prompts, through `tessera generate --input`
# (one engine, every request in flight at once): width-4 beam search returning 4 hypotheses
# against n = 4 samples at temperature 1, both with ignore_eos so that every returned sequence
# has exactly MAX_TOKENS tokens. Prints each run's line and the medians.
#   bench/beam_search.sh BUILD_DIR [REQUESTS=8] [PROMPT_LEN=64] [MAX_TOKENS=64] [RUNS=3]
set -euo pipefail
BUILD=${1:?usage: beam_search.sh BUILD_DIR [REQUESTS] [PROMPT_LEN] [MAX_TOKENS] [RUNS]}
REQ=${2:-8}
PLEN=${3:-64}
MAXT=${4:-64}
RUNS=${5:-3}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
"$BUILD/bin/random_model" "$WORK/model" small 1
python3 - "$WORK" "$REQ" "$PLEN" "$MAXT" <<'EOF'
import json, random, sys
work, req, plen, maxt = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
rng = random.Random(7)
prompts = [[rng.randrange(3, 32000) for _ in range(plen)] for _ in range(req)]
with open(f"{work}/beam.jsonl", "w") as f:
    for p in prompts:
        f.write(json.dumps({"prompt_ids": p, "max_tokens": maxt, "ignore_eos": True, "use_beam_search": True,
                            "n": 4, "best_of": 4}) + "\n")
with open(f"{work}/sample.jsonl", "w") as f:
    for i, p in enumerate(prompts):
        f.write(json.dumps({"prompt_ids": p, "max_tokens": maxt, "ignore_eos": True, "n": 4,
                            "temperature": 1.0, "seed": i}) + "\n")
EOF
declare -A rates
for run in $(seq "$RUNS"); do
  for kind in beam sample; do
    line=$("$BUILD/bin/tessera" generate --model "$WORK/model" --input "$WORK/$kind.jsonl" \
             --output "$WORK/$kind.out" --kv-cache-memory 2000000000 2>&1 | tail -1)
    echo "$kind run $run: $line"
    rate=$(echo "$line" | sed -E 's/.*\(([0-9.]+) tokens\/s\).*/\1/')
    rates[$kind]="${rates[$kind]:-} $rate"
  done
done
median() { printf '%s\n' $1 | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
b=$(median "${rates[beam]}")
s=$(median "${rates[sample]}")
echo "median tokens/s: beam search (width 4, 4 hypotheses) $b, n=4 sampling $s, ratio $(python3 -c "print(round($b/$s, 2))")"
