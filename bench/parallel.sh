#!/usr/bin/env bash
# Model-parallel overheads on this machine (docs/parallelism.md): the same model and global
# batch trained as dp2, tp2 and tp2 + sequence parallelism under `mpirun -np 2` (one core
# per rank), plus one process on both cores. Prints per layout the median step time and
# tokens/s, rank 0's tensor-parallel collectives, bytes and (exposed) time per step, and
# the activation bytes per rank (also with selective and full recomputation, with and
# without SP); then tp2 / dp2 step time (the bar: at most 1.3). Then
# pipeline parallelism: pp2 under each schedule at the same global batch (8 micro-batches
# of 1 sequence), and 1F1B at m = 4, 8, 16 micro-batches: the step time, the measured bubble
# (metrics pp_bubble: idle share of the pipeline span over both stages; pp_bubble_critical:
# the busiest stage's own idle share, the schedule's bubble once the faster stage's waiting
# on the slower is set apart as stage_imbalance) beside the formula (pp-1)/(v m+pp-1), the
# bytes sent and the time blocked receiving.
# Usage: bench/parallel.sh [BUILD_DIR] [STEPS]
set -euo pipefail
BUILD=${1:-build}
STEPS=${2:-20}
TESSERA=$(realpath "$BUILD/bin/tessera")
W=$(mktemp -d /tmp/tessera_parallel.XXXX)
trap 'rm -rf "$W"' EXIT
MPIRUN=(mpirun --oversubscribe -np 2)
[ "$(id -u)" = 0 ] && MPIRUN=(mpirun --allow-run-as-root --oversubscribe -np 2)

cat /usr/share/games/fortunes/*.u8 2>/dev/null > "$W/corpus.txt" || cat /usr/share/games/fortunes/* > "$W/corpus.txt"
"$TESSERA" tokenizer train --input "$W/corpus.txt" --vocab-size 2048 --out "$W/tok" > /dev/null 2>&1
"$TESSERA" data prepare --tokenizer "$W/tok" --input "$W/corpus.txt" --out "$W/data" > /dev/null 2>&1

config() {  # out_dir [parallel lines...]
  local out=$1; shift
  cat <<CFG
[run]
out_dir = "$out"
[model]
shape = "small"
hidden_size = 512
num_layers = 4
num_heads = 8
num_kv_heads = 4
intermediate_size = 1536
[data]
dir = "$W/data"
seq_len = 256
batch_size = 8
[training]
steps = $STEPS
precision = "${PRECISION:-fp32}"
activation_checkpointing = "${RECOMPUTE:-none}"
eval_batches = 0
[logging]
progress = false
peak_gflops = 100.0
plot = false
[checkpoint]
every = 0
[parallel]
CFG
  printf '%s\n' "$@"
}

run() {  # name np parallel-lines...
  local name=$1 np=$2; shift 2
  config "$W/$name" "$@" > "$W/$name.toml"
  if [ "$np" = 1 ]; then
    OMP_NUM_THREADS=2 "$TESSERA" train --config "$W/$name.toml" > "$W/$name.log" 2>&1
  else
    OMP_NUM_THREADS=1 "${MPIRUN[@]}" "$TESSERA" train --config "$W/$name.toml" > "$W/$name.log" 2>&1
  fi
}

# ONLY=pp: the pipeline runs alone (their rows, without the dp / tp comparison).
if [ "${ONLY:-}" != pp ]; then
run one 1 "zero_stage = 0"
run dp2 2 "dp = 2"
run tp2 2 "tp = 2"
run tp2_sp 2 "tp = 2" "sequence_parallel = true"
run tp2_sp_overlap 2 "tp = 2" "sequence_parallel = true" "sp_overlap = true"
# Activation memory per rank with recomputation, with and without SP.
RECOMPUTE=selective run tp2_selective 2 "tp = 2"
RECOMPUTE=selective run tp2_sp_selective 2 "tp = 2" "sequence_parallel = true"
RECOMPUTE=full run tp2_full 2 "tp = 2"
RECOMPUTE=full run tp2_sp_full 2 "tp = 2" "sequence_parallel = true"
fi
# Pipeline: micro-batches of one sequence (batch_size 1 x grad_accum m). pp2_same is the
# model above (4 layers, 2 + 2; its last stage also runs the 2048-token head) beside dp2.
# The bubble runs use 8 layers and a 512-token vocabulary, so the head is a small part of
# the last stage and the two stages do nearly the same work, as the formula assumes.
"$TESSERA" tokenizer train --input "$W/corpus.txt" --vocab-size 512 --out "$W/tok512" > /dev/null 2>&1
"$TESSERA" data prepare --tokenizer "$W/tok512" --input "$W/corpus.txt" --out "$W/data512" > /dev/null 2>&1
runpp() {  # name m layers data schedule-lines...
  local name=$1 m=$2 layers=$3 data=$4; shift 4
  config "$W/$name" "pp = 2" "$@" | sed -e "s/^batch_size = 8/batch_size = 1\ngrad_accum = $m/" \
    -e "s/^num_layers = 4/num_layers = $layers/" -e "s|^dir = .*|dir = \"$W/$data\"|" > "$W/$name.toml"
  OMP_NUM_THREADS=1 "${MPIRUN[@]}" "$TESSERA" train --config "$W/$name.toml" > "$W/$name.log" 2>&1
}
runpp pp2_same 8 4 data
runpp pp2_gpipe_m8 8 8 data512 'pp_schedule = "gpipe"'
runpp pp2_1f1b_m4 4 8 data512
runpp pp2_1f1b_m8 8 8 data512
runpp pp2_1f1b_m16 16 8 data512
runpp pp2_interleaved_m8 8 8 data512 'pp_schedule = "interleaved"' "pp_virtual_stages = 2"

python3 - "$W" "$STEPS" <<'PY'
import json, statistics, sys
w, steps = sys.argv[1], int(sys.argv[2])
out = {}
import os
only_pp = os.environ.get("ONLY") == "pp"
for name in ([] if only_pp else ["one", "dp2", "tp2", "tp2_sp", "tp2_sp_overlap", "tp2_selective", "tp2_sp_selective",
                                  "tp2_full", "tp2_sp_full"]):
    recs = [json.loads(l) for l in open(f"{w}/{name}/metrics.jsonl") if '"loss"' in l][3:]
    tps = statistics.median(r["tokens_per_s"] for r in recs)
    row = {"tokens_per_s": round(tps), "step_s": round(8 * 256 / tps, 4),
           "mem_activations_mb": round(recs[-1]["mem_activations"] / 2**20, 1)}
    if "tp_comm_s" in recs[-1]:
        row["tp_comm_s_per_step"] = round(statistics.median(r["tp_comm_s"] for r in recs), 4)
        row["tp_comm_mb_per_step"] = round(recs[-1]["tp_comm_bytes"] / 2**20, 1)
        row["tp_collectives_per_step"] = recs[-1]["tp_collectives"]
        row["tp_comm_share"] = round(row["tp_comm_s_per_step"] / row["step_s"], 3)
    out[name] = row
if not only_pp:
    out["tp2_over_dp2_step_time"] = round(out["tp2"]["step_s"] / out["dp2"]["step_s"], 3)
    out["tp2_sp_over_dp2_step_time"] = round(out["tp2_sp"]["step_s"] / out["dp2"]["step_s"], 3)
for name, m in [("pp2_same", 8), ("pp2_gpipe_m8", 8), ("pp2_1f1b_m4", 4), ("pp2_1f1b_m8", 8),
                ("pp2_1f1b_m16", 16), ("pp2_interleaved_m8", 8)]:
    recs = [json.loads(l) for l in open(f"{w}/{name}/metrics.jsonl") if '"loss"' in l][3:]
    tps = statistics.median(r["tokens_per_s"] for r in recs)
    bubble = statistics.median(r["pp_bubble"] for r in recs)
    critical = statistics.median(r["pp_bubble_critical"] for r in recs)
    formula = recs[-1]["pp_bubble_formula"]
    busy = [statistics.median(r["pp_stage_busy_s"][i] for r in recs) for i in range(2)]
    out[name] = {"tokens_per_s": round(tps), "step_s": round(m * 256 / tps, 4),
                 "bubble_measured": round(bubble, 4), "bubble_formula": round(formula, 4),
                 "bubble_over_formula": round(bubble / formula, 3),
                 "bubble_critical": round(critical, 4),
                 "critical_over_formula": round(critical / formula, 3),
                 "stage_imbalance": round(max(busy) / min(busy) - 1, 3),
                 "sent_mb_per_step": round(recs[-1]["pp_sent_bytes"] / 2**20, 2),
                 "recv_wait_s_per_step": round(statistics.median(r["pp_recv_wait_s"] for r in recs), 4),
                 "max_in_flight": recs[-1]["pp_max_in_flight"],
                 "stage_busy_s": [round(statistics.median(r["pp_stage_busy_s"][i] for r in recs), 4)
                                  for i in range(2)],
                 "mem_activations_mb": round(recs[-1]["mem_activations"] / 2**20, 1)}
if not only_pp:
    out["pp2_same_over_dp2_step_time"] = round(out["pp2_same"]["step_s"] / out["dp2"]["step_s"], 3)
print(json.dumps(out, indent=1))
PY
