#!/usr/bin/env bash
# Quantization quality on a model trained here (docs/quantization.md, "Quality"): trains a
# ~22M-parameter Llama-shaped model on the `fortunes` corpus (80% of it; the last 20% is
# held out: about 190,000 tokens, where 5% gave 48,000 and paired perplexity differences of
# 0.05% stayed within 2 standard errors), then quantizes it with each method and prints the
# held-out perplexity of every variant beside the float model's, with each variant's KL
# divergence from the float model on the same windows and its standard error (`eval
# perplexity --kl-reference`), and the calibrated int4 methods' perplexity paired against
# RTN's token by token.
#
#   bench/quant_quality.sh [BUILD=build] [OUT=runs/quant_quality]
#   STEPS=400 bench/quant_quality.sh      # training steps (default 400)
#   HELDOUT=5 bench/quant_quality.sh      # percent held out (default 20; docs' first tables: 5)
#   LR=0.003 bench/quant_quality.sh       # peak learning rate (default 0.002)
#
# Re-running reuses the trained model when OUT/run/model exists.
set -euo pipefail
BUILD=${1:-build}
OUT=${2:-runs/quant_quality}
STEPS=${STEPS:-400}
HELDOUT=${HELDOUT:-20}
LR=${LR:-0.002}
T=$BUILD/bin/tessera
FORTUNES=${FORTUNES:-/usr/share/games/fortunes}
mkdir -p "$OUT"

if [ ! -d "$OUT/run/model" ]; then
  # Every fortune file, "%" separators dropped, in a fixed order; the last HELDOUT% held out.
  find "$FORTUNES" -maxdepth 1 -type f ! -name '*.*' | sort | xargs cat | grep -v '^%$' > "$OUT/all.txt"
  total=$(wc -l < "$OUT/all.txt")
  head -n $((total * (100 - HELDOUT) / 100)) "$OUT/all.txt" > "$OUT/train.txt"
  tail -n +$((total * (100 - HELDOUT) / 100 + 1)) "$OUT/all.txt" > "$OUT/heldout.txt"
  "$T" tokenizer train --input "$OUT/train.txt" --vocab-size 4096 --out "$OUT/tok"
  rm -rf "$OUT/data"
  "$T" data prepare --tokenizer "$OUT/tok" --input "$OUT/train.txt" --out "$OUT/data" --quiet
  cat > "$OUT/train.toml" <<EOF
[run]
out_dir = "$OUT/run"
[model]
shape = "tiny"
hidden_size = 512
num_layers = 6
num_heads = 8
num_kv_heads = 4
intermediate_size = 1408
max_position_embeddings = 512
tie_word_embeddings = false
[data]
dir = "$OUT/data"
seq_len = 256
batch_size = 8
[optimizer]
name = "adamw"
lr = $LR
weight_decay = 0.1
[schedule]
kind = "cosine"
warmup_steps = $((STEPS / 10))
min_lr_ratio = 0.1
[training]
steps = $STEPS
precision = "bf16"
eval_every = $((STEPS / 4))
eval_batches = 8
[checkpoint]
every = $((STEPS / 2))
keep = 1
EOF
  "$T" train --config "$OUT/train.toml"
fi

M="$OUT/run/model"
ppl() {  # ppl LABEL MODEL [FLAGS...]: held-out perplexity, and the divergence from the f32 model
  local label=$1 model=$2 out
  shift 2
  out=$("$T" eval perplexity --model "$model" --data "$OUT/heldout.txt" --ctx 256 --kl-reference "$M" "$@" 2>/dev/null)
  printf '%-30s %-22s ln(ppl/f32) %-22s kld %-22s same-top %s\n' "$label" \
    "$(grep -o '^perplexity [0-9.]*' <<< "$out")" "$(sed -n 's/^ln_ppl_ratio //p' <<< "$out")" \
    "$(sed -n 's/^kld_mean //p' <<< "$out")" "$(sed -n 's/^same_top //p' <<< "$out")"
}
quant() {  # quant NAME FLAGS...: tessera quantize into OUT/q_NAME
  local name=$1
  shift
  rm -rf "$OUT/q_$name"
  "$T" quantize --model "$M" --out "$OUT/q_$name" --dtype f32 "$@" > "$OUT/q_$name.log" 2>&1
}
CALIB=(--calib "$OUT/train.txt" --calib-samples 64 --calib-seq 256)
quant int8_rtn --method rtn --bits 8
quant w8a8_sq --method smoothquant --bits 8 "${CALIB[@]}"
quant int4_rtn --method rtn --bits 4 --group-size 128
quant int4_gptq --method gptq --bits 4 --group-size 128 "${CALIB[@]}"
quant int4_awq --method awq --bits 4 --group-size 128 "${CALIB[@]}"
quant int8_rtn_head --method rtn --bits 8 --quantize-lm-head
quant int4_gptq_head --method gptq --bits 4 --group-size 128 --quantize-lm-head "${CALIB[@]}"

echo "held-out perplexity and divergence from f32 ($(wc -c < "$OUT/heldout.txt") bytes of fortunes, windows of 256 tokens)"
ppl "f32" "$M"
ppl "bf16" "$M" --dtype bf16
ppl "int8 W8A16 (rtn)" "$OUT/q_int8_rtn"
ppl "int8 W8A8 (smoothquant)" "$OUT/q_w8a8_sq"
ppl "int4 g128 (rtn)" "$OUT/q_int4_rtn"
ppl "int4 g128 (gptq)" "$OUT/q_int4_gptq"
ppl "int4 g128 (awq)" "$OUT/q_int4_awq"
ppl "int8 (rtn) + int8 head" "$OUT/q_int8_rtn_head"
ppl "int4 g128 (gptq) + int8 head" "$OUT/q_int4_gptq_head"
# The calibrated int4 methods against RTN, token by token: ln(ppl / rtn) with its standard
# error says whether a perplexity gain stands out of the text's noise.
for name in int4_gptq int4_awq; do
  printf '%-30s ln(ppl/rtn) %s\n' "$name vs int4 rtn" "$("$T" eval perplexity --model "$OUT/q_$name" \
    --data "$OUT/heldout.txt" --ctx 256 --kl-reference "$OUT/q_int4_rtn" 2>/dev/null | sed -n 's/^ln_ppl_ratio //p')"
done
