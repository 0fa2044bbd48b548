"""PyTorch reference for tests/model/mla_test.cc: DeepSeek-V2's DeepseekV2Attention
(modeling_deepseek.py, eager path) transcribed in float64: q through q_a_proj ->
q_a_layernorm -> q_b_proj (or q_proj), kv_a_proj_with_mqa split into the latent and the
rope key, kv_a_layernorm -> kv_b_proj split into k_nope and v per head, its
apply_rotary_pos_emb (de-interleave, then rotate_half) on q_pe and the shared k_pe, causal
softmax(q k^T * scale) v, o_proj.

Usage: mla_reference.py IN.safetensors OUT.safetensors
IN (float32): x (B T, H), dout (B T, H), the weights q_proj or q_a / q_a_norm / q_b,
kv_a, kv_a_norm, kv_b, o; __metadata__ B, T, heads, q_lora, kv_lora, nope, rope, v,
theta, eps.
OUT: out (B T, H) and the gradient of sum(out * dout) for x and every weight (d<name>).
"""
import sys

import numpy as np
import torch
from safetensors_np import load, save  # this directory


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids):
    cos = cos[position_ids].unsqueeze(1)
    sin = sin[position_ids].unsqueeze(1)
    b, h, s, d = q.shape
    q = q.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
    b, h, s, d = k.shape
    k = k.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def rms_norm(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def attention(p, m):
    B, T, heads = m["B"], m["T"], m["heads"]
    nope, rope, v_dim, kv_lora = m["nope"], m["rope"], m["v"], m["kv_lora"]
    qk = nope + rope
    hs = p["x"].view(B, T, -1)
    if m["q_lora"] > 0:
        q = rms_norm(hs @ p["q_a"].t(), p["q_a_norm"], m["eps"]) @ p["q_b"].t()
    else:
        q = hs @ p["q_proj"].t()
    q = q.view(B, T, heads, qk).transpose(1, 2)
    q_nope, q_pe = torch.split(q, [nope, rope], dim=-1)
    ckv = hs @ p["kv_a"].t()
    c, k_pe = torch.split(ckv, [kv_lora, rope], dim=-1)
    k_pe = k_pe.view(B, T, 1, rope).transpose(1, 2)
    kv = (rms_norm(c, p["kv_a_norm"], m["eps"]) @ p["kv_b"].t()).view(B, T, heads, nope + v_dim).transpose(1, 2)
    k_nope, value = torch.split(kv, [nope, v_dim], dim=-1)
    inv_freq = 1.0 / (m["theta"] ** (torch.arange(0, rope, 2, dtype=torch.float64) / rope))
    freqs = torch.outer(torch.arange(T, dtype=torch.float64), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    position_ids = torch.arange(T).unsqueeze(0).expand(B, T)
    q_pe, k_pe = apply_rotary_pos_emb(q_pe, k_pe, emb.cos(), emb.sin(), position_ids)
    query = torch.cat([q_nope, q_pe], dim=-1)
    key = torch.cat([k_nope, k_pe.expand(-1, heads, -1, -1)], dim=-1)
    scores = (query @ key.transpose(2, 3)) * qk ** -0.5
    mask = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
    scores = scores.masked_fill(mask, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ value
    out = out.transpose(1, 2).reshape(B * T, heads * v_dim)
    return out @ p["o"].t()


def main(inp, outp):
    t, meta = load(inp)
    m = {k: (float(v) if k in ("theta", "eps") else int(v)) for k, v in meta.items()}
    p = {k: torch.tensor(a, dtype=torch.float64, requires_grad=k != "dout") for k, a in t.items()}
    out = attention(p, m)
    (out * p["dout"]).sum().backward()
    res = {"out": out.detach().numpy().astype(np.float32)}
    for k, a in p.items():
        if k != "dout":
            res["d" + k] = a.grad.numpy().astype(np.float32)
    save(res, outp)
    print("ok")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
