#!/usr/bin/env bash
# Generates the PyTorch reference directories for every architecture (ctest fixture), plus
# DeepSeek-V2 / V3 with YaRN rope scaling (OUT/<arch>_yarn).
#   make_all.sh PYTHON OUT_DIR
set -euo pipefail
PY=$1
OUT=$2
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT"
for arch in llama qwen2 gpt2 mixtral qwen2_moe deepseek_v2 deepseek_v3; do
  rm -rf "$OUT/$arch.tmp"
  "$PY" "$HERE/make_reference.py" --arch "$arch" --out "$OUT/$arch.tmp"
  rm -rf "$OUT/$arch"
  mv "$OUT/$arch.tmp" "$OUT/$arch"
done
for arch in deepseek_v2 deepseek_v3; do
  rm -rf "$OUT/${arch}_yarn.tmp"
  "$PY" "$HERE/make_reference.py" --arch "$arch" --variant yarn --out "$OUT/${arch}_yarn.tmp"
  rm -rf "$OUT/${arch}_yarn"
  mv "$OUT/${arch}_yarn.tmp" "$OUT/${arch}_yarn"
done
