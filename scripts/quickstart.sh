#!/usr/bin/env bash
# The main job on a fresh machine: train a BPE tokenizer and a small Llama-shaped model
# on the `fortunes` corpus, then generate from it (a few minutes on 2 cores).
set -euo pipefail
BUILD=${1:-build}
"$BUILD/bin/tessera" quickstart --out runs/quickstart
