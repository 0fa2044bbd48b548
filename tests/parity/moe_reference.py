"""PyTorch reference for tests/model/moe_test.cc: transformers' MixtralSparseMoeBlock
(modeling_mixtral.py: softmax router in float, torch.topk, renormalised top-k weights,
experts w2(silu(w1 x) * w3 x) run over the tokens routed to them, index_add_ back) and
load_balancing_loss_func (over the router logits of every layer concatenated), in float64.

Usage: moe_reference.py IN.safetensors OUT.safetensors
IN (float32): per layer L (0, 1, ...): L.h (N, H), L.gate (E, H), L.w1 / L.w3 (E, F, H),
L.w2 (E, H, F), L.dout (N, H); __metadata__ {"top_k", "norm_topk_prob", "coef", "layers"}.
Loss: sum_L sum(out_L * dout_L) + coef * load_balancing_loss(all layers' logits).
OUT: per layer L.out, L.experts (N, top_k) i32 (torch.topk order), and the gradients
L.dh, L.dgate, L.dw1, L.dw2, L.dw3; aux (1) the balancing loss.
"""
import sys

import numpy as np
import torch
import torch.nn.functional as F
from safetensors_np import load, save  # this directory


def sparse_moe_block(h, gate, w1, w2, w3, top_k, norm_topk_prob):
    router_logits = h @ gate.t()
    routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float64)
    routing_weights, selected_experts = torch.topk(routing_weights, top_k, dim=-1)
    if norm_topk_prob:
        routing_weights = routing_weights / routing_weights.sum(dim=-1, keepdim=True)
    final = torch.zeros_like(h)
    num_experts = gate.shape[0]
    expert_mask = F.one_hot(selected_experts, num_classes=num_experts).permute(2, 1, 0)
    for e in range(num_experts):
        idx, top_x = torch.where(expert_mask[e])
        if top_x.numel() == 0:
            continue
        x = h[top_x]
        cur = (F.silu(x @ w1[e].t()) * (x @ w3[e].t())) @ w2[e].t()
        final.index_add_(0, top_x, cur * routing_weights[top_x, idx, None])
    return final, router_logits, selected_experts


def load_balancing_loss(gate_logits, num_experts, top_k):
    concatenated = torch.cat(gate_logits, dim=0)
    routing_weights = F.softmax(concatenated, dim=-1)
    _, selected = torch.topk(routing_weights, top_k, dim=-1)
    expert_mask = F.one_hot(selected, num_experts)
    tokens_per_expert = torch.mean(expert_mask.double(), dim=0)
    router_prob_per_expert = torch.mean(routing_weights, dim=0)
    return torch.sum(tokens_per_expert * router_prob_per_expert.unsqueeze(0)) * num_experts


def main(inp, outp):
    t, meta = load(inp)
    top_k, norm, coef, layers = int(meta["top_k"]), meta["norm_topk_prob"] == "true", float(meta["coef"]), int(meta["layers"])
    params, outs, logits, out = [], [], [], {}
    loss = torch.zeros((), dtype=torch.float64)
    for L in range(layers):
        p = {k: torch.tensor(t[f"{L}.{k}"], dtype=torch.float64, requires_grad=k != "dout")
             for k in ("h", "gate", "w1", "w2", "w3", "dout")}
        y, lg, sel = sparse_moe_block(p["h"], p["gate"], p["w1"], p["w2"], p["w3"], top_k, norm)
        loss = loss + (y * p["dout"]).sum()
        params.append(p)
        logits.append(lg)
        out[f"{L}.out"] = y.detach().numpy().astype(np.float32)
        out[f"{L}.experts"] = sel.numpy().astype(np.int32)
    aux = load_balancing_loss(logits, params[0]["gate"].shape[0], top_k)
    (loss + coef * aux).backward()
    for L, p in enumerate(params):
        for k in ("h", "gate", "w1", "w2", "w3"):
            out[f"{L}.d{k}"] = p[k].grad.numpy().astype(np.float32)
    out["aux"] = np.array([aux.item()], dtype=np.float32)
    save(out, outp)
    print("ok")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
