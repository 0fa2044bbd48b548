#!/usr/bin/env bash
# Generates the PyTorch reference directories for every architecture (ctest fixture), plus
# DeepSeek-V2 / V3 with YaRN rope scaling (OUT/<arch>_yarn) and the rope-scaling variants
# of Llama and Qwen2 (OUT/<arch>_<variant>).
#   make_all.sh PYTHON OUT_DIR
set -euo pipefail
PY=$1
OUT=$2
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT"
for arch in llama qwen2 qwen3 gemma2 gpt2 mixtral qwen2_moe deepseek_v2 deepseek_v3; do
  rm -rf "$OUT/$arch.tmp"
  "$PY" "$HERE/make_reference.py" --arch "$arch" --out "$OUT/$arch.tmp"
  rm -rf "$OUT/$arch"
  mv "$OUT/$arch.tmp" "$OUT/$arch"
done
for av in deepseek_v2:yarn deepseek_v2:aux deepseek_v3:yarn llama:rope_llama3 llama:rope_linear llama:rope_dynamic \
          llama:partial_rotary llama:hd32 llama:mistral_window qwen2:rope_yarn qwen2:sliding_window; do
  arch=${av%%:*} variant=${av#*:}
  rm -rf "$OUT/${arch}_$variant.tmp"
  "$PY" "$HERE/make_reference.py" --arch "$arch" --variant "$variant" --out "$OUT/${arch}_$variant.tmp"
  rm -rf "$OUT/${arch}_$variant"
  mv "$OUT/${arch}_$variant.tmp" "$OUT/${arch}_$variant"
done
