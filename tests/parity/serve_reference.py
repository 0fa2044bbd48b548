#!/usr/bin/env python3
"""PyTorch reference for the server's prompt-reading features on a model directory (Hugging
Face layout, e.g. the serve tests' model): for each prompt (a list of token ids), in float64,

  embedding        mean over positions of the final hidden states after the final norm
                   (LlamaModel.forward's output; vLLM's pooling type MEAN)
  prompt_logprobs  for tokens 1..T-1: log_softmax(logits of position i-1)[token i]
  top              for positions 0..T-2: the 5 most likely next tokens [[id, logprob], ...]

Usage: serve_reference.py --model DIR --prompts IN.json --out OUT.json
(IN.json: [[ids...], ...]; OUT.json: [{"embedding", "prompt_logprobs", "top"}, ...])
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_models  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    with open(a.prompts) as f:
        prompts = json.load(f)
    model = hf_models.load_model_dir(a.model)
    model = model.double().eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids], dtype=torch.long)
            hidden = model.model(x)[0]  # (T, H), after the final norm
            logp = torch.log_softmax(model.lm_head(hidden), dim=-1)  # (T, V)
            t = len(ids)
            top = torch.topk(logp[: t - 1], k=min(5, logp.shape[1]), dim=-1) if t > 1 else None
            out.append({
                "embedding": hidden.mean(dim=0).tolist(),
                "prompt_logprobs": [logp[i - 1, ids[i]].item() for i in range(1, t)],
                "top": [[[int(top.indices[i, k]), float(top.values[i, k])] for k in range(top.indices.shape[1])]
                        for i in range(t - 1)] if top is not None else [],
            })
    with open(a.out, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
