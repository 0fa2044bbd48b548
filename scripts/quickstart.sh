#!/usr/bin/env bash
# The main job on a fresh machine: create a small model in Hugging Face layout,
# reload it and generate from it (training arrives with the tokenizer and trainer).
set -euo pipefail
BUILD=${1:-build}
"$BUILD/bin/tessera" quickstart --out runs/quickstart
