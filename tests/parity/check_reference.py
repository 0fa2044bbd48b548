#!/usr/bin/python3
"""Self-test of a directory written by make_reference.py: validates the reference itself.

  check_reference.py DIR [DIR ...]

Reloads DIR with our own safetensors reader and checks that
  * the files are complete and in HF layout (names, shapes, tied lm_head left out),
  * logits, loss, every gradient and the bf16 logits recompute from the saved weights,
  * the loss equals an independent f64 log-sum-exp over the saved logits,
  * gradients agree with central finite differences of the model run in float64,
  * the f32 gradients agree with the float64 ones,
  * the vectorised model equals a naive per-token, per-head loop (explicit RoPE pair
    rotation, causal softmax over j <= t) in float64, and logits of every prefix equal
    the first rows of the full run (causality),
  * eval_nll matches a position-by-position recomputation of the windowed definition.
Exits non-zero on the first failed check.
"""
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_models  # noqa: E402
import make_reference  # noqa: E402
import safetensors_io  # noqa: E402


class CheckFailed(Exception):
    pass


def check(cond, msg):
    if not cond:
        raise CheckFailed(msg)


def max_rel(a, b):
    """max |a - b| / max(max |b|, tiny): error relative to the tensor's scale."""
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


# ----------------------------------------------------------------------------- naive model

def _naive_attention(q, k, v, nh, nkv, d, rope):
    """q: (T, nh*d), k/v: (T, nkv*d) f64; one token and one head at a time, j <= t only."""
    t_len = q.shape[0]
    out = torch.zeros_like(q)
    group = nh // nkv
    for t in range(t_len):
        for h in range(nh):
            g = h // group
            qt = rope(q[t, h * d:(h + 1) * d], t)
            scores = []
            for j in range(t + 1):
                kj = rope(k[j, g * d:(g + 1) * d], j)
                scores.append(float(qt @ kj) / math.sqrt(d))
            m = max(scores)
            e = [math.exp(s - m) for s in scores]
            z = sum(e)
            acc = torch.zeros(d, dtype=torch.float64)
            for j in range(t + 1):
                acc += (e[j] / z) * v[j, g * d:(g + 1) * d]
            out[t, h * d:(h + 1) * d] = acc
    return out


def _make_rope(d, theta):
    """HF convention: dims i and i + d/2 form a pair rotated by pos * theta^(-2i/d)."""
    half = d // 2

    def rope(x, pos):
        y = torch.empty_like(x)
        for i in range(half):
            ang = pos * theta ** (-2.0 * i / d)
            c, s = math.cos(ang), math.sin(ang)
            y[i] = x[i] * c - x[i + half] * s
            y[i + half] = x[i + half] * c + x[i] * s
        return y
    return rope


def naive_llama(cfg, p, ids):
    """ids: list of T ints -> logits (T, vocab) f64, written without any of hf_models."""
    nh = cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads") or nh
    d = cfg["hidden_size"] // nh
    eps = cfg["rms_norm_eps"]
    rope = _make_rope(d, cfg.get("rope_theta", 10000.0))

    def lin(name, x):
        y = x @ p[name + ".weight"].T
        return y + p[name + ".bias"] if name + ".bias" in p else y

    def rms(x, w):
        return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))

    x = p["model.embed_tokens.weight"][ids]
    for layer in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{layer}."
        h = rms(x, p[pre + "input_layernorm.weight"])
        att = _naive_attention(lin(pre + "self_attn.q_proj", h), lin(pre + "self_attn.k_proj", h),
                               lin(pre + "self_attn.v_proj", h), nh, nkv, d, rope)
        x = x + lin(pre + "self_attn.o_proj", att)
        h = rms(x, p[pre + "post_attention_layernorm.weight"])
        gate = lin(pre + "mlp.gate_proj", h)
        x = x + lin(pre + "mlp.down_proj", gate / (1.0 + torch.exp(-gate)) * lin(pre + "mlp.up_proj", h))
    x = rms(x, p["model.norm.weight"])
    head = p.get("lm_head.weight", p["model.embed_tokens.weight"])
    return x @ head.T


def naive_gpt2(cfg, p, ids):
    nh, hidden = cfg["n_head"], cfg["n_embd"]
    d = hidden // nh
    eps = cfg["layer_norm_epsilon"]

    def ln(x, pre):
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(var + eps) * p[pre + ".weight"] + p[pre + ".bias"]

    def conv(name, x):  # GPT-2 Conv1D: weight (in, out)
        return x @ p[name + ".weight"] + p[name + ".bias"]

    def gelu_new(x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))

    x = p["transformer.wte.weight"][ids] + p["transformer.wpe.weight"][: len(ids)]
    for layer in range(cfg["n_layer"]):
        pre = f"transformer.h.{layer}."
        qkv = conv(pre + "attn.c_attn", ln(x, pre + "ln_1"))
        q, k, v = qkv[:, :hidden], qkv[:, hidden:2 * hidden], qkv[:, 2 * hidden:]
        att = _naive_attention(q, k, v, nh, nh, d, lambda vec, pos: vec)
        x = x + conv(pre + "attn.c_proj", att)
        x = x + conv(pre + "mlp.c_proj", gelu_new(conv(pre + "mlp.c_fc", ln(x, pre + "ln_2"))))
    x = ln(x, "transformer.ln_f")
    return x @ p["transformer.wte.weight"].T


# ----------------------------------------------------------------------------- checks

def check_dir(path):
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(path, "generation_config.json")) as f:
        gen_cfg = json.load(f)
    check(gen_cfg.get("do_sample") is False and "eos_token_id" in gen_cfg, "generation_config.json incomplete")
    weights = safetensors_io.load_file(os.path.join(path, "model.safetensors"))
    ref = safetensors_io.load_file(os.path.join(path, "reference.safetensors"))
    arch = cfg["model_type"]
    vocab = cfg["vocab_size"]
    tied = cfg.get("tie_word_embeddings", arch == "gpt2")
    notes = []

    # --- layout
    model = hf_models.build_model(cfg)
    names = [n for n, _ in model.named_parameters()]
    check(sorted(weights) == sorted(names), f"model.safetensors names {sorted(set(weights) ^ set(names))} differ")
    check(("lm_head.weight" in weights) == (not tied), "lm_head.weight must be saved iff embeddings are untied")
    check(all(t.dtype == torch.float32 for t in weights.values()), "model.safetensors must be all F32")
    hf_models.load_weights(model, weights)
    model.eval()
    ids, targets = ref["input_ids"], ref["targets"]
    b, t = ids.shape
    check(ids.dtype == torch.int32 and targets.dtype == torch.int32, "input_ids/targets must be I32")
    check((b, t) == (make_reference.BATCH, make_reference.SEQ), f"input_ids shape {(b, t)}")
    check(int(ids.min()) >= 0 and int(ids.max()) < vocab, "input_ids out of vocab")
    check(torch.equal(targets[:, :-1][targets[:, :-1] != -100], ids[:, 1:][targets[:, :-1] != -100])
          and bool((targets[:, -1] == -100).all()), "targets are not input_ids shifted left")
    n_ignored = int((targets == -100).sum())
    check(n_ignored == b + len(make_reference.EXTRA_IGNORED), f"{n_ignored} ignored targets")
    expect = {"input_ids", "targets", "logits", "loss", "logits_bf16", "logits_bf16weights_f32compute",
              "eval_nll", "eval_ctx"} | {"grad." + n for n in names}
    check(set(ref) == expect, f"reference keys differ: {sorted(set(ref) ^ expect)}")
    for k in ("logits", "logits_bf16", "logits_bf16weights_f32compute"):
        check(tuple(ref[k].shape) == (b, t, vocab) and ref[k].dtype == torch.float32, f"{k} shape/dtype")
    for n, prm in model.named_parameters():
        g = ref["grad." + n]
        check(g.shape == prm.shape and g.dtype == torch.float32, f"grad.{n} shape/dtype")
        check(g.abs().max().item() > 0, f"grad.{n} is all zero: the test would be blind to that tensor")

    # --- (a) recompute logits, loss, gradients in f32
    x = ids.long()
    model.zero_grad(set_to_none=True)
    logits = model(x)
    loss = hf_models.lm_loss(logits, targets)
    loss.backward()
    check(max_rel(logits.detach(), ref["logits"]) <= 1e-6, "logits do not recompute")
    check(abs(loss.item() - ref["loss"].item()) <= 1e-6 * abs(ref["loss"].item()), "loss does not recompute")
    bit_exact = torch.equal(loss.detach().reshape(1), ref["loss"]) and torch.equal(logits.detach(), ref["logits"])
    notes.append("recompute bit-identical" if bit_exact else "recompute within 1e-6 (not bit-identical)")
    worst_g = max(max_rel(prm.grad, ref["grad." + n]) for n, prm in model.named_parameters())
    check(worst_g <= 1e-5, f"gradients do not recompute (rel {worst_g:.2e})")
    # independent loss: f64 log-sum-exp over the saved logits, mean over targets != -100
    lg = ref["logits"].double().reshape(-1, vocab)
    tg = targets.reshape(-1).long()
    keep = tg != -100
    manual = (torch.logsumexp(lg[keep], -1) - lg[keep].gather(1, tg[keep, None])[:, 0]).mean().item()
    check(abs(manual - ref["loss"].item()) <= 2e-6 * abs(manual), f"loss {ref['loss'].item()} != lse {manual}")
    check(ref["logits"].std().item() > 0.5, "logits nearly constant: the weights are too small")

    # --- (b) float64: naive loop, causality, FD gradients, f32 grads vs f64 grads
    m64 = hf_models.build_model(cfg).double()
    hf_models.load_weights(m64, {k: v.double() for k, v in weights.items()})
    m64.eval()
    p64 = {k: v.double() for k, v in weights.items()}
    naive = naive_gpt2 if arch == "gpt2" else naive_llama
    with torch.no_grad():
        full64 = m64(x)
        worst_naive = max(max_rel(full64[i], naive(cfg, p64, x[i].tolist())) for i in range(b))
        check(worst_naive <= 1e-12, f"model differs from naive per-token loop (rel {worst_naive:.2e})")
        worst_prefix = 0.0
        for k in range(1, t + 1):
            worst_prefix = max(worst_prefix, max_rel(m64(x[:, :k]), full64[:, :k]))
        check(worst_prefix <= 1e-12, f"prefix logits differ from the full run (rel {worst_prefix:.2e})")
        check(max_rel(full64, ref["logits"]) <= 1e-4, "f64 logits far from f32 reference")
    m64.zero_grad(set_to_none=True)
    loss64 = hf_models.lm_loss(m64(x), targets)
    loss64.backward()
    worst_f32g = max(max_rel(ref["grad." + n], prm.grad) for n, prm in m64.named_parameters())
    check(worst_f32g <= 1e-3, f"f32 reference gradients far from f64 ones (rel {worst_f32g:.2e})")
    gen = torch.Generator().manual_seed(0)
    params64 = dict(m64.named_parameters())
    fd_names = [names[0], names[1], names[-2], names[-1]]
    fd_names += [n for n in names if n.endswith("q_proj.bias") or n.endswith("c_attn.bias")][:1]
    worst_fd, n_fd = 0.0, 0
    for n in fd_names:
        prm = params64[n]
        flat_g = prm.grad.reshape(-1)
        picks = [int(flat_g.abs().argmax())] + torch.randint(0, flat_g.numel(), (2,), generator=gen).tolist()
        for idx in picks:
            eps = 1e-5
            with torch.no_grad():
                flat = prm.data.view(-1)
                orig = flat[idx].item()
                flat[idx] = orig + eps
                lp = hf_models.lm_loss(m64(x), targets).item()
                flat[idx] = orig - eps
                lm = hf_models.lm_loss(m64(x), targets).item()
                flat[idx] = orig
            fd = (lp - lm) / (2 * eps)
            an = flat_g[idx].item()
            err = abs(fd - an) / max(abs(an), 1e-3)
            worst_fd = max(worst_fd, err)
            n_fd += 1
            check(err <= 1e-6, f"finite difference of {n}[{idx}]: fd {fd:.10g} vs autograd {an:.10g}")

    # --- bf16 logits recompute and are plausibly bf16-sized errors
    import copy
    with torch.no_grad():
        lb = copy.deepcopy(model).to(torch.bfloat16)(x).float()
        check(max_rel(lb, ref["logits_bf16"]) <= 1e-2, "logits_bf16 does not recompute")
        rw = copy.deepcopy(model)
        for prm in rw.parameters():
            prm.copy_(prm.to(torch.bfloat16).float())
        check(max_rel(rw(x), ref["logits_bf16weights_f32compute"]) <= 1e-6, "bf16-weight logits do not recompute")
    err_bf16 = max_rel(ref["logits_bf16"], ref["logits"])
    err_rw = max_rel(ref["logits_bf16weights_f32compute"], ref["logits"])
    # Both are bf16-rounding sized (~1e-2 of the logit range), neither is zero; which one is
    # larger depends on the seed, so no order is asserted.
    check(0 < err_rw < 0.1 and 0 < err_bf16 < 0.1,
          f"bf16 errors implausible: full {err_bf16:.3g}, weights-only {err_rw:.3g}")

    # --- eval_nll: position-by-position form of the windowed definition, model in f64
    with open(os.path.join(path, "eval_ids.txt")) as f:
        lines = f.read().splitlines()
    eval_ids = [int(tok) for line in lines for tok in line.split()]
    ctx = int(ref["eval_ctx"].item())
    check(len(eval_ids) == make_reference.EVAL_TOKENS and all(len(ln.split()) <= 20 for ln in lines),
          "eval_ids.txt format")
    check(min(eval_ids) >= 0 and max(eval_ids) < vocab, "eval ids out of vocab")
    total, count, cache = 0.0, 0, {}
    with torch.no_grad():
        for i in range(len(eval_ids)):
            start = (i // ctx) * ctx
            if i == start:  # first token of a window has no context
                continue
            if start not in cache:
                window = torch.tensor(eval_ids[start:start + ctx])[None]
                cache[start] = torch.log_softmax(m64(window)[0], -1)
            total -= cache[start][i - start - 1, eval_ids[i]].item()
            count += 1
    nll = total / count
    check(abs(nll - ref["eval_nll"].item()) <= 1e-5 * nll, f"eval_nll {ref['eval_nll'].item()} != recomputed {nll}")

    notes.append(f"naive-loop rel {worst_naive:.1e}, prefix rel {worst_prefix:.1e}, "
                 f"{n_fd} FD grads worst rel {worst_fd:.1e}, f32-vs-f64 grad rel {worst_f32g:.1e}, "
                 f"bf16 logits rel err {err_bf16:.2e} (weights-only {err_rw:.2e}), eval_nll {nll:.6f} "
                 f"over {count} predicted tokens")
    return f"{path}: OK ({arch}, {len(names)} params tensors, tied={tied}; " + "; ".join(notes) + ")"


def main():
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        return 0 if len(sys.argv) >= 2 else 2
    failed = 0
    for path in sys.argv[1:]:
        try:
            print(check_dir(path))
        except (CheckFailed, ValueError, OSError, KeyError) as e:
            print(f"{path}: FAILED: {e}")
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
