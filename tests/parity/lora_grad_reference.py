#!/usr/bin/env python3
"""PyTorch reference for LoRA fine-tuning: a parity model directory (make_reference.py) with
LoRA adapters on its block linears, as PEFT's LoraLayer computes them:

    result = base_layer(x) + lora_B(lora_A(dropout(x))) * scaling,   scaling = lora_alpha / r

(peft/tuners/lora/layer.py, Linear.forward; dropout 0 here). The base is frozen; the loss is
the model's mean cross-entropy over the reference batch (DIR/reference.safetensors input_ids,
targets). Writes OUT (safetensors): loss, logits and grad.<PEFT name> for every A and B.

Usage: lora_grad_reference.py --model DIR --adapter ADAPTER.safetensors --alpha A --rank R --out OUT
(the adapter file holds PEFT names: base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight)
"""
import argparse
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_models  # noqa: E402
import safetensors_io  # noqa: E402


class LoraLinear(nn.Module):
    def __init__(self, base, a, b, scaling):
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.Linear(a.shape[1], a.shape[0], bias=False)
        self.lora_B = nn.Linear(b.shape[1], b.shape[0], bias=False)
        with torch.no_grad():
            self.lora_A.weight.copy_(a)
            self.lora_B.weight.copy_(b)
        self.scaling = scaling

    def forward(self, x):
        return self.base_layer(x) + self.lora_B(self.lora_A(x)) * self.scaling


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--adapter", required=True)
    ap.add_argument("--alpha", type=float, required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    model = hf_models.load_model_dir(a.model)
    for p in model.parameters():
        p.requires_grad_(False)
    adapter = safetensors_io.load_file(a.adapter)
    prefix = "base_model.model."
    wrapped = {}
    for name in sorted(adapter):
        if not name.endswith(".lora_A.weight"):
            continue
        module_path = name[len(prefix):-len(".lora_A.weight")]  # model.layers.0.self_attn.q_proj
        parent_path, child = module_path.rsplit(".", 1)
        parent = model.get_submodule(parent_path)
        lora = LoraLinear(getattr(parent, child), adapter[name].float(),
                          adapter[name.replace("lora_A", "lora_B")].float(), a.alpha / a.rank)
        setattr(parent, child, lora)
        wrapped[prefix + module_path] = lora
    ref = safetensors_io.load_file(os.path.join(a.model, "reference.safetensors"))
    ids, targets = ref["input_ids"].long(), ref["targets"]
    logits = model(ids)
    loss = hf_models.lm_loss(logits, targets)
    loss.backward()
    out = {"loss": loss.detach().float().reshape(1), "logits": logits.detach().float()}
    for path, lora in wrapped.items():
        out["grad." + path + ".lora_A.weight"] = lora.lora_A.weight.grad.detach().float().clone()
        out["grad." + path + ".lora_B.weight"] = lora.lora_B.weight.grad.detach().float().clone()
    safetensors_io.save_file(out, a.out)


if __name__ == "__main__":
    main()
