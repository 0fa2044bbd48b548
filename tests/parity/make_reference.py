#!/usr/bin/python3
"""Writes a tiny random Hugging Face model directory plus PyTorch reference outputs.

  make_reference.py --arch {llama,qwen2,qwen3,gpt2,mixtral,qwen2_moe,deepseek_v2,deepseek_v3} --out DIR
                    [--seed N] [--variant NAME]

DIR gets config.json, generation_config.json, model.safetensors (f32, HF tensor names),
eval_ids.txt and reference.safetensors (inputs, targets, logits, loss, every gradient,
bf16 logits, eval NLL). Tessera's C++ parity tests load DIR and compare against it.
A model with a multi-token-prediction module (DeepSeek-V3) trains on
loss = loss_main + MTP_LOSS_WEIGHT * loss_mtp; its reference adds loss_main, loss_mtp and
mtp_logits, and the metadata mtp_loss_weight.
"""
import argparse
import copy
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_models  # noqa: E402
import safetensors_io  # noqa: E402

BATCH, SEQ = 3, 17
EVAL_TOKENS, EVAL_CTX = 300, 128
# Fixed extra ignore positions (batch, position) besides the last position of every row.
EXTRA_IGNORED = [(0, 5), (1, 11), (2, 0)]
# Weight of the multi-token-prediction loss (DeepSeek-V3's lambda) in the reference loss.
MTP_LOSS_WEIGHT = 0.3

_TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def _llama_config():
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", **_TINY,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "rope_scaling": None,
        "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False,
        "attention_dropout": 0.0, "mlp_bias": False, "pretraining_tp": 1, "initializer_range": 0.02,
        "use_cache": True, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
    }


def _qwen2_config():
    return {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **_TINY,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_scaling": None,
        "tie_word_embeddings": True, "hidden_act": "silu", "attention_dropout": 0.0,
        "use_sliding_window": False, "sliding_window": 128, "max_window_layers": 2,
        "initializer_range": 0.02, "use_cache": True, "torch_dtype": "float32",
        "bos_token_id": 95, "eos_token_id": 96,
    }


def _qwen3_config():
    # head_dim 24 apart from hidden / heads (16), as Qwen3's 128 is apart from its hidden size.
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **_TINY, "head_dim": 24,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_scaling": None,
        "tie_word_embeddings": True, "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
        "use_sliding_window": False, "sliding_window": None, "max_window_layers": 2,
        "initializer_range": 0.02, "use_cache": True, "torch_dtype": "float32",
        "bos_token_id": 95, "eos_token_id": 96,
    }


def _gemma2_config():
    # Gemma 2 in small: head_dim 24 apart from hidden / heads, query_pre_attn_scalar 20 apart
    # from head_dim, caps low enough to bend the tiny model's scores (2.0) and logits (3.0),
    # a window of 5 on the even layers.
    return {
        "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", **_TINY, "head_dim": 24,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 20, "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0,
        "sliding_window": 5, "attention_bias": False, "tie_word_embeddings": True,
        "initializer_range": 0.02, "use_cache": True, "torch_dtype": "float32",
        "bos_token_id": 2, "eos_token_id": 1,
    }


def _gpt2_config():
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 97,
        "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 128, "n_ctx": 128, "n_inner": None,
        "layer_norm_epsilon": 1e-5, "activation_function": "gelu_new", "tie_word_embeddings": True,
        # Dropout off: the reference gradients are deterministic and so must Tessera's be.
        "attn_pdrop": 0.0, "embd_pdrop": 0.0, "resid_pdrop": 0.0,
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False, "initializer_range": 0.02, "use_cache": True,
        "torch_dtype": "float32", "bos_token_id": 96, "eos_token_id": 96,
    }


def _mixtral_config():
    return {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", **_TINY,
        "num_local_experts": 4, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02,
        "output_router_logits": True, "router_jitter_noise": 0.0, "sliding_window": None,
        "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "rope_scaling": None,
        "tie_word_embeddings": False, "hidden_act": "silu", "attention_dropout": 0.0,
        "initializer_range": 0.02, "use_cache": True, "torch_dtype": "float32",
        "bos_token_id": 1, "eos_token_id": 2,
    }


def _qwen2_moe_config():
    return {
        "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", **_TINY,
        "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 40,
        "shared_expert_intermediate_size": 80, "norm_topk_prob": False, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "router_aux_loss_coef": 0.05, "output_router_logits": True,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_scaling": None,
        "tie_word_embeddings": False, "hidden_act": "silu", "attention_dropout": 0.0,
        "use_sliding_window": False, "sliding_window": 128, "max_window_layers": 2,
        "initializer_range": 0.02, "use_cache": True, "torch_dtype": "float32",
        "bos_token_id": 95, "eos_token_id": 96,
    }


def _deepseek_v2_config():
    return {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
        **{**_TINY, "num_key_value_heads": 4, "num_hidden_layers": 3},
        "q_lora_rank": None, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
        "v_head_dim": 16, "moe_intermediate_size": 24, "n_routed_experts": 8, "n_shared_experts": 2,
        "num_experts_per_tok": 2, "first_k_dense_replace": 1, "moe_layer_freq": 1, "ep_size": 1,
        "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2, "scoring_func": "softmax",
        "norm_topk_prob": False, "routed_scaling_factor": 1.5, "aux_loss_alpha": 0.0, "seq_aux": True,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_scaling": None,
        "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False,
        "attention_dropout": 0.0, "pretraining_tp": 1, "initializer_range": 0.02, "use_cache": True,
        "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
    }


def _deepseek_v3_config():
    return {
        **_deepseek_v2_config(),
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "q_lora_rank": 48, "n_shared_experts": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
        "norm_topk_prob": True, "routed_scaling_factor": 2.5, "num_nextn_predict_layers": 1,
    }


BASE_CONFIGS = {"llama": _llama_config, "qwen2": _qwen2_config, "qwen3": _qwen3_config, "gemma2": _gemma2_config,
                "gpt2": _gpt2_config,
                "mixtral": _mixtral_config,
                "qwen2_moe": _qwen2_moe_config, "deepseek_v2": _deepseek_v2_config,
                "deepseek_v3": _deepseek_v3_config}
# DeepSeek's YaRN (mscale values as DeepSeek-V2/V3 ship them). original_max_position_embeddings
# 128 puts the correction range at rotary dims [0, 2] of qk_rope_head_dim 8 (the low end
# clamped up from -1): of the 4 frequencies the first stays, the second is the mean of the plain
# and the /factor one, the last two are divided by factor; the scale gains mscale(40, 0.707)^2.
_DEEPSEEK_YARN = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 128, "beta_fast": 32,
                  "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}
# Variants override keys of the base config, to cover the other branch of each option.
VARIANTS = {
    # Rope scaling as transformers computes it (hf_models.ScaledRotaryEmbedding). head_dim 16,
    # theta 1e4: wavelengths 6.3 .. 19869 positions, so llama3 (original 64: high-frequency
    # wavelength 16, low 64) keeps the first frequency, smooths the next two and divides the
    # rest by 8; dynamic NTK rescales past max_position_embeddings 12 (the batch's 17 tokens,
    # the 128-token eval windows).
    "llama": {"default": {}, "tied": {"tie_word_embeddings": True},
              "mha": {"num_key_value_heads": 4},
              "rope_llama3": {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
              "rope_linear": {"rope_scaling": {"type": "linear", "factor": 4.0}},
              "rope_dynamic": {"rope_scaling": {"type": "dynamic", "factor": 2.0}, "max_position_embeddings": 12},
              "partial_rotary": {"partial_rotary_factor": 0.5},
              # head_dim 32 (2 query heads over 1 kv head): the size native bf16 training
              # runs on AMX tiles (kernels/cpu/attention_amx.cc); the others' 16 and 24 stay f32.
              "hd32": {"num_attention_heads": 2, "num_key_value_heads": 1},
              # Mistral: every layer sees the last 5 positions (the batch's 17, the 128-token
              # eval windows).
              "mistral_window": {"architectures": ["MistralForCausalLM"], "model_type": "mistral",
                                 "sliding_window": 5}},
    # YaRN over an original 4096 positions at theta 1e6: frequencies 0-1 kept, 2-3 ramped,
    # 4-7 divided by 4; cos and sin times 0.1 ln 4 + 1.
    "qwen2": {"default": {}, "untied": {"tie_word_embeddings": False},
              "rope_yarn": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                             "original_max_position_embeddings": 4096}},
              # Layer 1 of 2 windowed (6 positions), layer 0 full, as max_window_layers 1 says.
              "sliding_window": {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1}},
    "qwen3": {"default": {}},
    "gemma2": {"default": {}},
    "gpt2": {"default": {}, "n_inner": {"n_inner": 96}},
    "mixtral": {"default": {}},
    "qwen2_moe": {"default": {}},
    "deepseek_v2": {"default": {}, "yarn": {"rope_scaling": _DEEPSEEK_YARN},
                    # its balancing loss trained, per sequence (large alpha: visible in every gradient)
                    "aux": {"aux_loss_alpha": 0.3, "seq_aux": True}},
    # (V3's: mscale apart from mscale_all_dim, so cos and sin are scaled too)
    "deepseek_v3": {"default": {}, "yarn": {"rope_scaling": {**_DEEPSEEK_YARN, "mscale": 1.0}}},
}


def make_config(arch, variant):
    if variant not in VARIANTS[arch]:
        raise SystemExit(f"--variant '{variant}' is not one of {sorted(VARIANTS[arch])} for --arch {arch}")
    return {**BASE_CONFIGS[arch](), **VARIANTS[arch][variant]}


def init_weights(model, gen):
    """Large-ish random weights so every parameter visibly moves the logits and the loss."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            # (layernorm also covers DeepSeek's q_a_layernorm / kv_a_layernorm)
            # (Gemma's norms store their weight as an offset from 1.)
            gemma_norm = "gemma" in getattr(model, "config", {}).get("model_type", "") and name.endswith("norm.weight")
            is_norm = any(k in name for k in ("layernorm", "model.norm", "ln_1", "ln_2", "ln_f",
                                              ".enorm.", ".hnorm.", ".shared_head.norm.", ".q_norm.", ".k_norm."))
            if gemma_norm:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif is_norm and name.endswith(".weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".e_score_correction_bias"):
                # DeepSeek-V3's selection bias: non-zero so that it changes the routing.
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif "wpe" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name or "wte" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))


def make_batch(vocab, gen):
    """input_ids (B, T) int32 and targets (B, T) int32 (next token, -100 = ignored)."""
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=gen, dtype=torch.int64)
    ids[1, 3] = vocab - 1  # make sure both ends of the odd-sized vocab occur
    ids[2, 7] = 0
    targets = torch.full_like(ids, -100)
    targets[:, :-1] = ids[:, 1:]
    for b, t in EXTRA_IGNORED:
        targets[b, t] = -100
    return ids.to(torch.int32), targets.to(torch.int32)


def eval_windows(ids, ctx):
    """Consecutive non-overlapping windows of <= ctx ids; a window of one id predicts nothing."""
    return [ids[s:s + ctx] for s in range(0, len(ids), ctx) if len(ids[s:s + ctx]) >= 2]


@torch.no_grad()
def eval_nll(model, ids, ctx):
    """Token-weighted mean of -log p(w[t] | w[:t]) over t = 1..L-1 of every window (f64 sums)."""
    total, count = torch.zeros((), dtype=torch.float64), 0
    for w in eval_windows(ids, ctx):
        x = torch.tensor(w, dtype=torch.long)[None]
        logp = torch.log_softmax(model(x)[0, :-1].double(), dim=-1)
        total += -logp.gather(1, x[0, 1:, None]).sum()
        count += len(w) - 1
    return (total / count).item()


def write_eval_ids(path, ids):
    with open(path, "w") as f:
        for i in range(0, len(ids), 20):
            f.write(" ".join(str(x) for x in ids[i:i + 20]) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", required=True, choices=sorted(BASE_CONFIGS))
    ap.add_argument("--out", required=True, help="model directory to create (or overwrite files in)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--variant", default="default")
    args = ap.parse_args()
    t0 = time.time()

    cfg = make_config(args.arch, args.variant)
    gen = torch.Generator().manual_seed(args.seed)
    model = hf_models.build_model(cfg)
    init_weights(model, gen)
    model.eval()
    vocab = cfg["vocab_size"]

    ids, targets = make_batch(vocab, gen)
    model.zero_grad(set_to_none=True)
    has_mtp = getattr(model, "has_mtp", False)
    if has_mtp:  # DeepSeek-V3: main loss + MTP_LOSS_WEIGHT x the MTP module's loss
        logits, mtp_logits = model.forward_mtp(ids.long())
        loss_main = hf_models.lm_loss(logits, targets)
        loss_mtp = hf_models.lm_loss(mtp_logits, hf_models.mtp_targets(targets))
        loss = loss_main + MTP_LOSS_WEIGHT * loss_mtp
    else:
        logits = model(ids.long())
        loss = hf_models.lm_loss(logits, targets)
    if cfg.get("output_router_logits"):  # MixtralForCausalLM: + router_aux_loss_coef x balancing loss
        loss = loss + cfg["router_aux_loss_coef"] * hf_models.load_balancing_loss(model)
    for module in model.modules():  # DeepSeek-V2 with aux_loss_alpha: + each MoE layer's balancing loss
        if hasattr(module, "last_aux"):
            loss = loss + module.last_aux
    loss.backward()
    for module in model.modules():  # router logits kept for the balancing loss (graph tensors)
        module.__dict__.pop("last_router_logits", None)
        module.__dict__.pop("last_aux", None)
    ref = {
        "input_ids": ids, "targets": targets,
        "logits": logits.detach().float(),
        "loss": loss.detach().float().reshape(1),
    }
    for name, module in model.named_modules():  # DeepSeek: each MoE layer's chosen experts (N, k)
        if hasattr(module, "last_topk_idx") and ".layers." in name:
            layer = int(name.split(".layers.")[1].split(".")[0])
            ref[f"experts.{layer}"] = module.last_topk_idx.to(torch.int32).contiguous()
    if has_mtp:
        ref["loss_main"] = loss_main.detach().float().reshape(1)
        ref["loss_mtp"] = loss_mtp.detach().float().reshape(1)
        ref["mtp_logits"] = mtp_logits.detach().float()
    for name, p in model.named_parameters():
        if not p.requires_grad:  # DeepSeek-V3's e_score_correction_bias: not trained by backprop
            continue
        if p.grad is None:  # an expert no token was routed to: its gradient is zero
            print(f"make_reference: note: {name} got no gradient (stored as zeros)")
            ref["grad." + name] = torch.zeros(p.shape, dtype=torch.float32)
            continue
        ref["grad." + name] = p.grad.detach().float().clone()

    with torch.no_grad():
        # As transformers does with torch_dtype=bfloat16: weights and activations in bf16.
        model_bf16 = copy.deepcopy(model).to(torch.bfloat16)
        ref["logits_bf16"] = model_bf16(ids.long()).float()
        # f32 arithmetic on bf16-rounded weights: isolates weight rounding from bf16 compute.
        model_rw = copy.deepcopy(model)
        for p in model_rw.parameters():
            p.copy_(p.to(torch.bfloat16).float())
        ref["logits_bf16weights_f32compute"] = model_rw(ids.long()).float()

    eval_ids = torch.randint(0, vocab, (EVAL_TOKENS,), generator=gen).tolist()
    nll = eval_nll(model, eval_ids, EVAL_CTX)
    ref["eval_nll"] = torch.tensor([nll], dtype=torch.float32)
    ref["eval_ctx"] = torch.tensor([EVAL_CTX], dtype=torch.int32)

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    with open(os.path.join(args.out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"],
                   "max_new_tokens": 16, "do_sample": False}, f, indent=2)
        f.write("\n")
    weights = hf_models.saved_state(model)
    safetensors_io.save_file(weights, os.path.join(args.out, "model.safetensors"))
    write_eval_ids(os.path.join(args.out, "eval_ids.txt"), eval_ids)
    meta = {"format": "pt", "arch": args.arch, "variant": args.variant, "seed": str(args.seed),
            "torch_version": torch.__version__, "generator": "tests/parity/make_reference.py"}
    if has_mtp:
        meta["mtp_loss_weight"] = str(MTP_LOSS_WEIGHT)
    safetensors_io.save_file(ref, os.path.join(args.out, "reference.safetensors"), metadata=meta)

    n_params = sum(t.numel() for t in weights.values())
    print(f"make_reference: {args.arch}/{args.variant} seed {args.seed} -> {args.out}: "
          f"{len(weights)} tensors ({n_params} params, tied={cfg.get('tie_word_embeddings')}), "
          f"loss {loss.item():.6f}, eval_nll {nll:.6f} over {EVAL_TOKENS} ids ctx {EVAL_CTX}, "
          f"max|logits_bf16-logits| {(ref['logits_bf16'] - ref['logits']).abs().max().item():.3g}, "
          f"{len(ref)} reference tensors, {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
