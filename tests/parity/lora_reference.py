#!/usr/bin/env python3
"""PyTorch reference for merging a PEFT LoRA adapter into its base model, transcribed from
peft/tuners/lora/layer.py (Linear.merge / get_delta_weight): W + lora_B @ lora_A * scaling,
scaling = lora_alpha / r (lora_alpha / sqrt(r) with use_rslora).

Usage: lora_reference.py BASE_DIR ADAPTER_DIR OUT.safetensors
BASE_DIR holds model.safetensors; ADAPTER_DIR adapter_config.json and
adapter_model.safetensors. OUT gets, for every adapted module, its merged weight under the
base model's name (model.layers.0.self_attn.q_proj.weight), f32.
"""
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import safetensors_io  # noqa: E402


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    base_dir, adapter_dir, out = sys.argv[1:]
    base = safetensors_io.load_file(os.path.join(base_dir, "model.safetensors"))
    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        cfg = json.load(f)
    r, alpha = cfg["r"], cfg["lora_alpha"]
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    adapter = safetensors_io.load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    prefix = "base_model.model."
    merged = {}
    for name, a in adapter.items():
        if not name.endswith(".lora_A.weight"):
            continue
        module = name[len(prefix):-len(".lora_A.weight")]
        b = adapter[name.replace(".lora_A.", ".lora_B.")]
        w = base[module + ".weight"].to(torch.float32)
        merged[module + ".weight"] = (w + (b.to(torch.float32) @ a.to(torch.float32)) * scaling).contiguous()
    safetensors_io.save_file(merged, out)


if __name__ == "__main__":
    main()
