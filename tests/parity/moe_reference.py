"""PyTorch reference for tests/model/moe_test.cc: transformers' MixtralSparseMoeBlock
(modeling_mixtral.py: softmax router, torch.topk, renormalised top-k weights, experts
w2(silu(w1 x) * w3 x) run over the tokens routed to them, index_add_ back) and
load_balancing_loss_func (over the router logits of every layer concatenated), in float64,
through hf_models.routed_experts and hf_models.balancing_loss.

Usage: moe_reference.py IN.safetensors OUT.safetensors
IN (float32): per layer L (0, 1, ...): L.h (N, H), L.gate (E, H), L.w1 / L.w3 (E, F, H),
L.w2 (E, H, F), L.dout (N, H); __metadata__ {"top_k", "norm_topk_prob", "coef", "layers"}.
Optional: DeepSeek's gate (deepseek_gate): metadata "scoring" (softmax | sigmoid),
"n_group", "topk_group", "group_score" (max | top2), "scaling" (routed_scaling_factor).
Optional: L.bias (E) a selection bias, chosen on softmax + bias and weighted by softmax
(DeepSeek-V3's noaux_tc, modeling_deepseek.py MoEGate), and metadata "capacity" c > 0:
each expert takes at most ceil(c N top_k / E) slots, first come (token, then choice) first
served (GShard / Switch), the rest dropped. Either one routes through
capacity_routed_experts (coef must then be 0).
Optional: metadata "ds_alpha" > 0 adds DeepSeek-V2's balancing loss of every layer
(modeling_deepseek.py MoEGate.forward in training, deepseek_v2_aux below) over "ds_groups"
sequences of N / ds_groups tokens, sequence-wise when "ds_seq_aux" is "true".
Loss: sum_L sum(out_L * dout_L) + coef * load_balancing_loss(all layers' logits)
(+ sum_L deepseek_v2_aux_L).
OUT: per layer L.out, L.experts (N, top_k) i32 (torch.topk order), and the gradients
L.dh, L.dgate, L.dw1, L.dw2, L.dw3; aux (1) the balancing loss; ds_aux (1) the sum of the
layers' DeepSeek-V2 losses (alpha included).
"""
import math
import sys

import numpy as np
import torch
import torch.nn.functional as F
import hf_models  # this directory
from safetensors_np import load, save  # this directory


class _Expert:
    """One Mixtral expert over float64 weights: w2(silu(w1 x) * w3 x)."""

    def __init__(self, w1, w2, w3):
        self.w1, self.w2, self.w3 = w1, w2, w3

    def __call__(self, x):
        return (F.silu(x @ self.w1.t()) * (x @ self.w3.t())) @ self.w2.t()


def sparse_moe_block(h, gate, w1, w2, w3, top_k, norm_topk_prob):
    router_logits = h @ gate.t()
    experts = [_Expert(w1[e], w2[e], w3[e]) for e in range(gate.shape[0])]
    final = hf_models.routed_experts(h, router_logits, experts, top_k, norm_topk_prob)
    selected_experts = torch.topk(F.softmax(router_logits, dim=1, dtype=torch.float64), top_k, dim=-1)[1]
    return final, router_logits, selected_experts


def deepseek_gate(router_logits, top_k, norm_topk_prob, bias, scoring, n_group, topk_group, group_score,
                  scaling):
    """DeepSeek's MoEGate (modeling_deepseek.py, V2 and V3): softmax or sigmoid scores, a
    selection bias (V3's e_score_correction_bias), group-limited choice (a group scores its
    best expert, V2's group_limited_greedy, or its two best, V3's noaux_tc; the groups not
    kept are masked to 0), weights from the unbiased scores, renormalised, times
    routed_scaling_factor. Returns (selected (N, k), weights (N, k))."""
    scores = F.softmax(router_logits, dim=1) if scoring == "softmax" else router_logits.sigmoid()
    choice = scores if bias is None else scores + bias
    n, e = scores.shape
    if n_group > 1:
        grouped = choice.view(n, n_group, -1)
        group_scores = grouped.max(dim=-1).values if group_score == "max" else grouped.topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(n, n_group, e // n_group).reshape(n, -1)
        choice = choice.masked_fill(~score_mask.bool(), 0.0)
    selected = torch.topk(choice, top_k, dim=-1)[1]
    weights = scores.gather(1, selected)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return selected, weights * scaling


def deepseek_v2_aux(scores, topk_idx, alpha, bsz, seq_aux, n_routed_experts, top_k):
    """DeepSeek-V2's MoEGate.forward (modeling_deepseek.py), its training branch with
    alpha > 0: the auxiliary loss from the scores (N, E) and the chosen experts (N, k)."""
    seq_len = scores.shape[0] // bsz
    topk_idx_for_aux_loss = topk_idx.view(bsz, -1)
    if seq_aux:
        scores_for_seq_aux = scores.view(bsz, seq_len, -1)
        ce = torch.zeros(bsz, n_routed_experts, dtype=scores.dtype)
        ce.scatter_add_(1, topk_idx_for_aux_loss,
                        torch.ones(bsz, seq_len * top_k, dtype=scores.dtype)).div_(seq_len * top_k / n_routed_experts)
        return (ce * scores_for_seq_aux.mean(dim=1)).sum(dim=1).mean() * alpha
    mask_ce = F.one_hot(topk_idx_for_aux_loss.view(-1), num_classes=n_routed_experts)
    ce = mask_ce.to(scores.dtype).mean(0)
    Pi = scores.mean(0)
    fi = ce * n_routed_experts
    return (Pi * fi).sum() * alpha


def capacity_routed_experts(h, router_logits, experts, top_k, norm_topk_prob, bias, capacity, **gate):
    """Routing with a selection bias and an expert capacity, token by token."""
    selected, weights = deepseek_gate(router_logits, top_k, norm_topk_prob, bias, **gate)
    n, e = router_logits.shape
    cap = math.ceil(capacity * n * top_k / e - 1e-9) if capacity > 0 else n * top_k
    count, rows, dropped = [0] * e, [], 0
    for t in range(n):
        row = torch.zeros_like(h[t])
        for j in range(top_k):
            x = int(selected[t, j])
            if count[x] < cap:
                count[x] += 1
                row = row + weights[t, j] * experts[x](h[t:t + 1])[0]
            else:
                dropped += 1
        rows.append(row)
    return torch.stack(rows), selected, dropped


def main(inp, outp):
    t, meta = load(inp)
    top_k, norm, coef, layers = int(meta["top_k"]), meta["norm_topk_prob"] == "true", float(meta["coef"]), int(meta["layers"])
    capacity = float(meta.get("capacity", "0"))
    gate = {"scoring": meta.get("scoring", "softmax"), "n_group": int(meta.get("n_group", "1")),
            "topk_group": int(meta.get("topk_group", "1")), "group_score": meta.get("group_score", "max"),
            "scaling": float(meta.get("scaling", "1"))}
    plain = gate == {"scoring": "softmax", "n_group": 1, "topk_group": 1, "group_score": "max", "scaling": 1.0}
    ds_alpha, ds_groups = float(meta.get("ds_alpha", "0")), int(meta.get("ds_groups", "1"))
    ds_seq_aux = meta.get("ds_seq_aux", "true") == "true"
    params, outs, logits, out = [], [], [], {}
    loss = torch.zeros((), dtype=torch.float64)
    ds_aux = torch.zeros((), dtype=torch.float64)
    for L in range(layers):
        p = {k: torch.tensor(t[f"{L}.{k}"], dtype=torch.float64, requires_grad=k != "dout")
             for k in ("h", "gate", "w1", "w2", "w3", "dout")}
        bias = torch.tensor(t[f"{L}.bias"], dtype=torch.float64) if f"{L}.bias" in t else None
        if bias is None and capacity == 0 and plain:
            y, lg, sel = sparse_moe_block(p["h"], p["gate"], p["w1"], p["w2"], p["w3"], top_k, norm)
        else:
            assert coef == 0, "the balancing loss is transformers' plain top-k's"
            lg = p["h"] @ p["gate"].t()
            experts = [_Expert(p["w1"][x], p["w2"][x], p["w3"][x]) for x in range(p["gate"].shape[0])]
            y, sel, dropped = capacity_routed_experts(p["h"], lg, experts, top_k, norm, bias, capacity, **gate)
            out[f"{L}.dropped"] = np.array([dropped], dtype=np.int32)
        loss = loss + (y * p["dout"]).sum()
        if ds_alpha > 0:
            scores = F.softmax(lg, dim=-1) if gate["scoring"] == "softmax" else lg.sigmoid()
            ds_aux = ds_aux + deepseek_v2_aux(scores, sel, ds_alpha, ds_groups, ds_seq_aux, p["gate"].shape[0], top_k)
        params.append(p)
        logits.append(lg)
        out[f"{L}.out"] = y.detach().numpy().astype(np.float32)
        out[f"{L}.experts"] = sel.numpy().astype(np.int32)
    aux = hf_models.balancing_loss(logits, params[0]["gate"].shape[0], top_k)
    (loss + coef * aux + ds_aux).backward()
    for L, p in enumerate(params):
        for k in ("h", "gate", "w1", "w2", "w3"):
            out[f"{L}.d{k}"] = p[k].grad.numpy().astype(np.float32)
    out["aux"] = np.array([aux.item()], dtype=np.float32)
    out["ds_aux"] = np.array([ds_aux.item()], dtype=np.float32)
    save(out, outp)
    print("ok")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
