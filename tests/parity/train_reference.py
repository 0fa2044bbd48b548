#!/usr/bin/python3
"""PyTorch reference training run for Tessera's loss-curve parity test.

  train_reference.py --model DIR --batches FILE --settings FILE --out FILE

DIR holds the initial weights (config.json + model.safetensors, HF names); FILE
(safetensors) holds ids/targets shaped (steps, grad_accum, batch, seq) in the order the
C++ run consumes them; settings (JSON) gives lr, betas, eps, weight_decay, warmup_steps,
total_steps, min_lr_ratio, max_grad_norm. Trains with torch.optim.AdamW (no decay on
embeddings, norms and biases), gradient accumulation, torch.nn.utils.clip_grad_norm_ and
linear warmup + cosine decay in fp32, and writes the per-step losses as JSON.
"""
import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_models  # noqa: E402
import safetensors_io  # noqa: E402


def lr_multiplier(s, step):
    """Linear warmup then cosine to min_lr_ratio at the last step (docs/optimizers.md)."""
    n = step + 1
    warm, total, lo = s["warmup_steps"], s["total_steps"], s["min_lr_ratio"]
    if n <= warm:
        return n / warm
    q = min(1.0, (n - warm) / (total - warm))
    return lo + (1 - lo) * (1 + math.cos(math.pi * q)) / 2


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--batches", required=True)
    ap.add_argument("--settings", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)  # a tiny model: threads only add overhead
    with open(a.settings) as f:
        s = json.load(f)
    model = hf_models.load_model_dir(a.model)
    model.train()
    batches = safetensors_io.load_file(a.batches)
    ids, targets = batches["ids"].long(), batches["targets"].long()
    steps, accum = ids.shape[0], ids.shape[1]

    decay, no_decay = [], []
    for name, p in model.named_parameters():
        embedding = "embed_tokens" in name or ".wte." in name or ".wpe." in name
        (decay if p.dim() == 2 and not embedding else no_decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": s["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=s["lr"], betas=(s["beta1"], s["beta2"]), eps=s["eps"])
    losses = []
    for step in range(steps):
        opt.zero_grad(set_to_none=False)
        total = 0.0
        for micro in range(accum):
            loss = hf_models.lm_loss(model(ids[step, micro]), targets[step, micro])
            (loss / accum).backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), s["max_grad_norm"])
        for g in opt.param_groups:
            g["lr"] = s["lr"] * lr_multiplier(s, step)
        opt.step()
        losses.append(total / accum)
    with open(a.out, "w") as f:
        json.dump({"losses": losses}, f)


if __name__ == "__main__":
    main()
