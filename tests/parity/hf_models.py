"""Plain-PyTorch copies of Hugging Face LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, GPT2LMHeadModel,
MixtralForCausalLM, Qwen2MoeForCausalLM and DeepSeek-V2 / V3 (DeepseekV2ForCausalLM).

This is Tessera's independent reference for model parity tests. Each module follows the
eager code path of `transformers` (modeling_llama.py, modeling_qwen2.py, modeling_gpt2.py,
modeling_mixtral.py, modeling_qwen2_moe.py; DeepSeek's remote-code modeling_deepseek.py)
operation by operation, including where HF changes dtype, so that running it in float32,
float64 or bfloat16 gives what `transformers` would give with attn_implementation="eager".
Parameter names are exactly the keys HF writes to model.safetensors.

Only what a causal-LM forward/backward needs is here: no KV cache, no padding mask, no
dropout (Tessera trains without it; HF dropout is inactive in eval). Rope scaling:
transformers' modeling_rope_utils.py types linear, dynamic, yarn and llama3
(ScaledRotaryEmbedding), partial_rotary_factor as modeling_phi.py applies it, and
DeepSeek's YaRN (DeepseekV2YarnRotaryEmbedding).
"""
import json
import math
import os

import torch
import torch.nn.functional as F
from torch import nn

# DeepSeek's attention and gate come from the stand-alone references of this directory
# (looked up at call time: moe_reference imports this module too).
import mla_reference  # noqa: E402
import moe_reference  # noqa: E402
import safetensors_io  # noqa: E402


# ----------------------------------------------------------------------------- helpers

def _causal_additive_mask(t, dtype, device):
    """(1, 1, T, T) mask: 0 where key <= query, finfo(dtype).min above the diagonal.

    HF's eager Llama/Qwen2 add this mask (not -inf) to the scores, in the scores' dtype."""
    mask = torch.full((t, t), torch.finfo(dtype).min, dtype=dtype, device=device)
    mask = torch.triu(mask, diagonal=1)
    return mask[None, None, :, :]


def _sliding_additive_mask(t, window, dtype, device):
    """The causal mask that also hides keys j <= i - window (transformers' sliding_window_overlay:
    query i sees keys (i - window, i])."""
    i = torch.arange(t, device=device)[:, None]
    j = torch.arange(t, device=device)[None, :]
    hidden = (j > i) | (j <= i - window)
    mask = torch.zeros((t, t), dtype=dtype, device=device).masked_fill(hidden, torch.finfo(dtype).min)
    return mask[None, None, :, :]


def layer_windows(cfg):
    """Per layer: its sliding window or 0, as transformers' layer_types say (mistral / mixtral
    sliding_window; qwen2 use_sliding_window from layer max_window_layers on)."""
    n = cfg["num_hidden_layers"]
    kind = cfg.get("model_type")
    if kind in ("mistral", "mixtral"):
        w = cfg.get("sliding_window") or 0
        return [w] * n
    if kind in ("qwen2", "qwen2_moe", "qwen3") and cfg.get("use_sliding_window", False):
        w, first = cfg.get("sliding_window") or 0, cfg.get("max_window_layers", 28)
        return [w if i >= first else 0 for i in range(n)]
    return [0] * n


def _upcast_dtype(dtype):
    """Where HF upcasts to f32 we do too, except that f64 stays f64.

    HF would silently drop an f64 model to f32 in RMSNorm, rotary and softmax; f64 runs exist
    here only to check gradients by finite differences, which need every op in f64.
    For f32 and bf16 models this is exactly HF's behaviour."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _activation(name):
    if name == "silu":
        return F.silu
    if name == "gelu_new":
        # transformers.activations.NewGELUActivation (tanh approximation, written out).
        return lambda x: 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
    if name == "gelu_pytorch_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    if name == "relu":
        return F.relu
    raise ValueError(f"unsupported activation '{name}'")


def lm_loss(logits, targets):
    """Mean cross-entropy over positions whose target != -100.

    logits: (B, T, V) any float dtype (upcast to f32 as HF's ForCausalLMLoss does);
    targets: (B, T) integer, already shifted (targets[:, t] is the token after position t)."""
    return F.cross_entropy(logits.to(_upcast_dtype(logits.dtype)).reshape(-1, logits.shape[-1]),
                           targets.long().reshape(-1), ignore_index=-100, reduction="mean")


# ----------------------------------------------------------------------------- Llama / Qwen2

class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))  # (hidden,)
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        # Statistics in f32 (even for bf16 models); the cast back to the input dtype happens
        # BEFORE the weight multiply, exactly as HF does.
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(_upcast_dtype(input_dtype))
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class LlamaRotaryEmbedding(nn.Module):
    """cos/sin for positions, computed in f32 whatever the model dtype, then cast to x.dtype.

    inv_freq is recomputed from `base` instead of being a buffer so that model.to(bf16 / f64)
    cannot change its precision: HF always forces f32 here (it upcasts inv_freq in forward)."""

    def __init__(self, dim, base):
        super().__init__()
        self.dim = dim
        self.base = base

    def inv_freq(self, device, dtype=torch.float32):
        return 1.0 / (self.base ** (torch.arange(0, self.dim, 2, dtype=torch.int64).to(device, dtype) / self.dim))

    def forward(self, x, position_ids):
        # position_ids: (B, T) -> cos, sin: (B, T, head_dim) in x.dtype
        ct = _upcast_dtype(x.dtype)
        inv_freq = self.inv_freq(x.device, ct)
        inv_freq_expanded = inv_freq[None, :, None].expand(position_ids.shape[0], -1, 1)
        position_ids_expanded = position_ids[:, None, :].to(ct)
        with torch.autocast(device_type=x.device.type, enabled=False):
            freqs = (inv_freq_expanded @ position_ids_expanded).transpose(1, 2)
            emb = torch.cat((freqs, freqs), dim=-1)
            scale = getattr(self, "attention_scaling", 1.0)  # yarn's factor, in f32 as transformers
            cos = emb.cos() * scale
            sin = emb.sin() * scale
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


# YaRN as modeling_deepseek.py (V2 and V3 alike) computes it.

def yarn_find_correction_dim(num_rotations, dim, base=10000, max_position_embeddings=2048):
    """The (fractional) rotary dimension whose wavelength fits num_rotations times into
    max_position_embeddings."""
    return (dim * math.log(max_position_embeddings / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def yarn_find_correction_range(low_rot, high_rot, dim, base=10000, max_position_embeddings=2048):
    low = math.floor(yarn_find_correction_dim(low_rot, dim, base, max_position_embeddings))
    high = math.ceil(yarn_find_correction_dim(high_rot, dim, base, max_position_embeddings))
    return max(low, 0), min(high, dim - 1)  # clamped as DeepSeek does


def yarn_get_mscale(scale=1, mscale=1):
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_linear_ramp_mask(min, max, dim, dtype=torch.float32):
    """0 up to min, linear to 1 at max, 1 beyond (over indices 0..dim-1). DeepSeek builds it
    in f32; dtype is there only for the f64 runs (see _upcast_dtype)."""
    if min == max:
        max += 0.001  # prevent singularity
    linear_func = (torch.arange(dim, dtype=dtype) - min) / (max - min)
    return torch.clamp(linear_func, 0, 1)


class DeepseekV2YarnRotaryEmbedding(LlamaRotaryEmbedding):
    """modeling_deepseek.py DeepseekV2YarnRotaryEmbedding: per frequency, a blend of the plain
    one (freq_extra) and the one divided by `factor` (freq_inter), the unscaled ones kept below
    the correction range [low, high] found from beta_fast / beta_slow rotations over
    original_max_position_embeddings, a linear ramp across it; cos and sin are multiplied by
    mscale = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim).

    Like LlamaRotaryEmbedding, inv_freq is recomputed in the computation dtype (f32, f64 for
    f64 runs) instead of being a buffer that model.to() could change."""

    def __init__(self, dim, base, scaling_factor, original_max_position_embeddings, beta_fast=32, beta_slow=1,
                 mscale=1, mscale_all_dim=0):
        super().__init__(dim, base)
        self.scaling_factor = scaling_factor
        self.original_max_position_embeddings = original_max_position_embeddings
        self.beta_fast = beta_fast
        self.beta_slow = beta_slow
        # The factor on cos and sin (DeepSeek's _mscale), a Python float.
        self.mscale = float(yarn_get_mscale(scaling_factor, mscale) / yarn_get_mscale(scaling_factor, mscale_all_dim))

    def inv_freq(self, device, dtype=torch.float32):
        dim = self.dim
        exponent = torch.arange(0, dim, 2, dtype=dtype, device=device) / dim
        freq_extra = 1.0 / (self.base ** exponent)
        freq_inter = 1.0 / (self.scaling_factor * self.base ** exponent)
        low, high = yarn_find_correction_range(self.beta_fast, self.beta_slow, dim, self.base,
                                               self.original_max_position_embeddings)
        inv_freq_mask = 1.0 - yarn_linear_ramp_mask(low, high, dim // 2, dtype).to(device=device, dtype=dtype)
        return freq_inter * (1 - inv_freq_mask) + freq_extra * inv_freq_mask


class ScaledRotaryEmbedding(LlamaRotaryEmbedding):
    """transformers' rotary embedding with rope_scaling (modeling_rope_utils.py's
    _compute_{linear_scaling,dynamic_ntk,yarn,llama3}_parameters), inv_freq in f32 as there:
    cos and sin are multiplied by the attention factor (yarn). Dynamic NTK recomputes the
    frequencies for each forward from its longest position (dynamic_rope_update's seq_len =
    max(position_ids) + 1), unchanged up to max_position_embeddings. Yarn keeps the config's
    factor and takes the correction range over original_max_position_embeddings when given
    (else max_position_embeddings), as transformers does since its fix of issue 38224."""

    def __init__(self, dim, base, scaling, max_position_embeddings):
        super().__init__(dim, base)
        self.scaling = dict(scaling)
        self.kind = scaling.get("rope_type", scaling.get("type"))
        self.max_pos = max_position_embeddings
        self.seq_len = None
        self.attention_scaling = 1.0
        if self.kind == "yarn":
            factor = scaling.get("factor")
            original = scaling.get("original_max_position_embeddings") or max_position_embeddings
            if factor is None:
                factor = max_position_embeddings / original
            self.factor, self.original = factor, original
            af = scaling.get("attention_factor")
            mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
            if af is None:
                if mscale and mscale_all_dim:
                    af = float(yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim))
                else:
                    af = yarn_get_mscale(factor)
            self.attention_scaling = af
        elif self.kind not in ("linear", "dynamic", "llama3"):
            raise ValueError(f"rope_scaling type '{self.kind}' is not supported by the parity reference")

    def default_inv_freq(self, base, device, dtype):
        return 1.0 / (base ** (torch.arange(0, self.dim, 2, dtype=torch.int64).to(device, dtype) / self.dim))

    def inv_freq(self, device, dtype=torch.float32):
        rs, dim = self.scaling, self.dim
        if self.kind == "linear":
            return self.default_inv_freq(self.base, device, dtype) / rs["factor"]
        if self.kind == "dynamic":
            factor = rs["factor"]
            seq_len = self.seq_len if self.seq_len is not None and self.seq_len > self.max_pos else self.max_pos
            base = self.base * ((factor * seq_len / self.max_pos) - (factor - 1)) ** (dim / (dim - 2))
            return self.default_inv_freq(base, device, dtype)
        if self.kind == "llama3":
            inv_freq = self.default_inv_freq(self.base, device, dtype)
            factor, low_ff, high_ff = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
            old_context_len = rs["original_max_position_embeddings"]
            low_freq_wavelen = old_context_len / low_ff
            high_freq_wavelen = old_context_len / high_ff
            wavelen = 2 * math.pi / inv_freq
            inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
            smooth_factor = (old_context_len / wavelen - low_ff) / (high_ff - low_ff)
            smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
            is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
            return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)
        # yarn
        beta_fast = rs.get("beta_fast") or 32
        beta_slow = rs.get("beta_slow") or 1
        truncate = rs.get("truncate", True)

        def find_correction_dim(num_rotations):
            return (dim * math.log(self.original / (num_rotations * 2 * math.pi))) / (2 * math.log(self.base))

        low, high = find_correction_dim(beta_fast), find_correction_dim(beta_slow)
        if truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        pos_freqs = self.base ** (torch.arange(0, dim, 2).to(device, dtype) / dim)
        inv_freq_extrapolation = 1.0 / pos_freqs
        inv_freq_interpolation = 1.0 / (self.factor * pos_freqs)
        extrapolation_factor = 1 - yarn_linear_ramp_mask(low, high, dim // 2, dtype).to(device)
        return inv_freq_interpolation * (1 - extrapolation_factor) + inv_freq_extrapolation * extrapolation_factor

    def forward(self, x, position_ids):
        self.seq_len = int(position_ids.max()) + 1
        return super().forward(x, position_ids)


def rotary_embedding(cfg, head_dim):
    """LlamaRotaryEmbedding over int(head_dim x partial_rotary_factor) features, scaled as
    config.json's rope_scaling says."""
    dim = int(head_dim * cfg.get("partial_rotary_factor", 1.0))
    base = cfg.get("rope_theta", 10000.0)
    rs = cfg.get("rope_scaling")
    if not rs or rs.get("rope_type", rs.get("type")) == "default":
        return LlamaRotaryEmbedding(dim, base=base)
    return ScaledRotaryEmbedding(dim, base, rs, cfg["max_position_embeddings"])


def _deepseek_rope_scaling(cfg):
    """config.json rope_scaling (null or DeepSeek's yarn) -> None or the yarn keyword arguments."""
    rs = cfg.get("rope_scaling")
    if not rs:
        return None
    kind = rs.get("type", rs.get("rope_type"))
    if kind != "yarn":
        raise ValueError(f"rope_scaling type '{kind}' is not supported by the DeepSeek parity reference (yarn)")
    kwargs = {"scaling_factor": rs["factor"],
              "original_max_position_embeddings": rs["original_max_position_embeddings"]}
    for key in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
        if key in rs:
            kwargs[key] = rs[key]
    return kwargs


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def repeat_kv(hidden_states, n_rep):
    """(B, kv_heads, T, d) -> (B, kv_heads * n_rep, T, d); head h uses kv head h // n_rep."""
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class LlamaMLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        h, i = cfg["hidden_size"], cfg["intermediate_size"]
        bias = bool(cfg.get("mlp_bias", False))
        self.gate_proj = nn.Linear(h, i, bias=bias)  # weight (inter, hidden)
        self.up_proj = nn.Linear(h, i, bias=bias)    # weight (inter, hidden)
        self.down_proj = nn.Linear(i, h, bias=bias)  # weight (hidden, inter)
        self.act_fn = _activation(cfg.get("hidden_act", "silu"))

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class LlamaAttention(nn.Module):
    def __init__(self, cfg, qkv_bias, o_bias):
        super().__init__()
        self.hidden_size = cfg["hidden_size"]
        self.num_heads = cfg["num_attention_heads"]
        self.head_dim = cfg.get("head_dim") or self.hidden_size // self.num_heads
        self.num_key_value_heads = cfg.get("num_key_value_heads") or self.num_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        if self.num_heads % self.num_key_value_heads != 0:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=o_bias)
        # Qwen3Attention: RMSNorm over each head's q and k (head_dim weights), before RoPE.
        self.qk_norm = cfg.get("model_type") == "qwen3"
        if self.qk_norm:
            self.q_norm = LlamaRMSNorm(self.head_dim, eps=cfg["rms_norm_eps"])
            self.k_norm = LlamaRMSNorm(self.head_dim, eps=cfg["rms_norm_eps"])
        self.rotary_emb = rotary_embedding(cfg, self.head_dim)
        self.rotary_dim = self.rotary_emb.dim

    def forward(self, hidden_states, position_ids, attention_mask):
        bsz, q_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states)
        key_states = self.k_proj(hidden_states)
        value_states = self.v_proj(hidden_states)

        query_states = query_states.view(bsz, q_len, self.num_heads, self.head_dim)
        key_states = key_states.view(bsz, q_len, self.num_key_value_heads, self.head_dim)
        if self.qk_norm:
            query_states, key_states = self.q_norm(query_states), self.k_norm(key_states)
        query_states = query_states.transpose(1, 2)
        key_states = key_states.transpose(1, 2)
        value_states = value_states.view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)

        cos, sin = self.rotary_emb(value_states, position_ids)
        if self.rotary_dim < self.head_dim:  # partial rotary, as modeling_phi.py
            r = self.rotary_dim
            q_rot, k_rot = apply_rotary_pos_emb(query_states[..., :r], key_states[..., :r], cos, sin)
            query_states = torch.cat((q_rot, query_states[..., r:]), dim=-1)
            key_states = torch.cat((k_rot, key_states[..., r:]), dim=-1)
        else:
            query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)

        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(self.head_dim)
        attn_weights = attn_weights + attention_mask
        # HF upcasts the softmax to f32 and casts the probabilities back to the model dtype.
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=_upcast_dtype(attn_weights.dtype)).to(query_states.dtype)
        attn_output = torch.matmul(attn_weights, value_states)

        attn_output = attn_output.transpose(1, 2).contiguous()
        attn_output = attn_output.reshape(bsz, q_len, self.num_heads * self.head_dim)
        return self.o_proj(attn_output)


def routed_experts(hidden_states, router_logits, experts, top_k, norm_topk_prob):
    """The routed part of transformers' MixtralSparseMoeBlock / Qwen2MoeSparseMoeBlock
    forward: softmax router in float, torch.topk, renormalised weights (always in Mixtral,
    under norm_topk_prob in Qwen2-MoE), each expert over the tokens routed to it,
    index_add_ back. hidden_states (T, H) -> (T, H)."""
    routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
    routing_weights, selected_experts = torch.topk(routing_weights, top_k, dim=-1)
    if norm_topk_prob:
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
    routing_weights = routing_weights.to(hidden_states.dtype)
    final = torch.zeros_like(hidden_states)
    expert_mask = F.one_hot(selected_experts, num_classes=len(experts)).permute(2, 1, 0)
    for expert_idx, expert in enumerate(experts):
        idx, top_x = torch.where(expert_mask[expert_idx])
        current_state = hidden_states[None, top_x].reshape(-1, hidden_states.shape[-1])
        current = expert(current_state) * routing_weights[top_x, idx, None]
        final.index_add_(0, top_x, current.to(hidden_states.dtype))
    return final


def balancing_loss(gate_logits, num_experts, top_k):
    """transformers' load_balancing_loss_func: over the router logits of every layer,
    concatenated (the loss is taken over all layers' tokens)."""
    concatenated = torch.cat(gate_logits, dim=0)
    routing_weights = F.softmax(concatenated, dim=-1)
    _, selected_experts = torch.topk(routing_weights, top_k, dim=-1)
    expert_mask = F.one_hot(selected_experts, num_experts)
    tokens_per_expert = torch.mean(expert_mask.to(routing_weights.dtype), dim=0)
    router_prob_per_expert = torch.mean(routing_weights, dim=0)
    return torch.sum(tokens_per_expert * router_prob_per_expert.unsqueeze(0)) * num_experts


class MixtralBlockSparseTop2MLP(nn.Module):
    """modeling_mixtral.py: w2(act(w1 x) * w3 x)."""

    def __init__(self, cfg):
        super().__init__()
        h, i = cfg["hidden_size"], cfg["intermediate_size"]
        self.w1 = nn.Linear(h, i, bias=False)
        self.w2 = nn.Linear(i, h, bias=False)
        self.w3 = nn.Linear(h, i, bias=False)
        self.act_fn = _activation(cfg.get("hidden_act", "silu"))

    def forward(self, x):
        return self.w2(self.act_fn(self.w1(x)) * self.w3(x))


class MixtralSparseMoeBlock(nn.Module):
    """modeling_mixtral.py: softmax router in float, top-k, renormalised weights, each
    expert over the tokens routed to it, index_add_ back."""

    def __init__(self, cfg):
        super().__init__()
        self.hidden_dim = cfg["hidden_size"]
        self.num_experts = cfg["num_local_experts"]
        self.top_k = cfg["num_experts_per_tok"]
        self.gate = nn.Linear(self.hidden_dim, self.num_experts, bias=False)
        self.experts = nn.ModuleList([MixtralBlockSparseTop2MLP(cfg) for _ in range(self.num_experts)])

    def forward(self, hidden_states):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(hidden_states)
        self.last_router_logits = router_logits  # for load_balancing_loss (output_router_logits)
        final = routed_experts(hidden_states, router_logits, self.experts, self.top_k, True)
        return final.reshape(batch_size, sequence_length, hidden_dim)


class Qwen2MoeMLP(nn.Module):
    def __init__(self, cfg, intermediate_size):
        super().__init__()
        h = cfg["hidden_size"]
        self.gate_proj = nn.Linear(h, intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, h, bias=False)
        self.act_fn = _activation(cfg.get("hidden_act", "silu"))

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Qwen2MoeSparseMoeBlock(nn.Module):
    """modeling_qwen2_moe.py: MixtralSparseMoeBlock's routing (renormalised only under
    norm_topk_prob) plus a shared expert every token goes through, scaled by
    sigmoid(shared_expert_gate(x))."""

    def __init__(self, cfg):
        super().__init__()
        self.num_experts = cfg["num_experts"]
        self.top_k = cfg["num_experts_per_tok"]
        self.norm_topk_prob = cfg["norm_topk_prob"]
        self.gate = nn.Linear(cfg["hidden_size"], self.num_experts, bias=False)
        self.experts = nn.ModuleList([Qwen2MoeMLP(cfg, cfg["moe_intermediate_size"]) for _ in range(self.num_experts)])
        self.shared_expert = Qwen2MoeMLP(cfg, cfg["shared_expert_intermediate_size"])
        self.shared_expert_gate = nn.Linear(cfg["hidden_size"], 1, bias=False)

    def forward(self, hidden_states):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(hidden_states)
        self.last_router_logits = router_logits
        final = routed_experts(hidden_states, router_logits, self.experts, self.top_k, self.norm_topk_prob)
        shared = self.shared_expert(hidden_states)
        shared = F.sigmoid(self.shared_expert_gate(hidden_states)) * shared
        final = final + shared
        return final.reshape(batch_size, sequence_length, hidden_dim)


def load_balancing_loss(model):
    """balancing_loss over every sparse block's router logits of the last forward. The
    blocks forget them (a module holding graph tensors cannot be deep-copied)."""
    blocks = [m for m in model.modules() if isinstance(m, (MixtralSparseMoeBlock, Qwen2MoeSparseMoeBlock))]
    logits = [b.__dict__.pop("last_router_logits") for b in blocks]
    return balancing_loss(logits, blocks[0].num_experts, blocks[0].top_k)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg, qkv_bias, o_bias):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, qkv_bias, o_bias)
        if cfg.get("model_type") == "mixtral":
            self.block_sparse_moe = MixtralSparseMoeBlock(cfg)
        elif cfg.get("model_type") == "qwen2_moe":
            self.mlp = Qwen2MoeSparseMoeBlock(cfg)
        else:
            self.mlp = LlamaMLP(cfg)
        self.input_layernorm = LlamaRMSNorm(cfg["hidden_size"], eps=cfg["rms_norm_eps"])
        self.post_attention_layernorm = LlamaRMSNorm(cfg["hidden_size"], eps=cfg["rms_norm_eps"])

    def forward(self, hidden_states, position_ids, attention_mask):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = self.self_attn(hidden_states, position_ids, attention_mask)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        if hasattr(self, "block_sparse_moe"):
            hidden_states = self.block_sparse_moe(hidden_states)
        else:
            hidden_states = self.mlp(hidden_states)
        return residual + hidden_states


class LlamaModel(nn.Module):
    def __init__(self, cfg, qkv_bias, o_bias):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])  # (vocab, hidden)
        self.layers = nn.ModuleList(
            [LlamaDecoderLayer(cfg, qkv_bias, o_bias) for _ in range(cfg["num_hidden_layers"])])
        self.norm = LlamaRMSNorm(cfg["hidden_size"], eps=cfg["rms_norm_eps"])
        self.windows = layer_windows(cfg)

    def forward(self, input_ids):
        bsz, t = input_ids.shape
        hidden_states = self.embed_tokens(input_ids)
        position_ids = torch.arange(t, device=input_ids.device).unsqueeze(0).expand(bsz, t)
        mask = _causal_additive_mask(t, hidden_states.dtype, hidden_states.device)
        for layer, window in zip(self.layers, self.windows):
            m = mask if window == 0 else _sliding_additive_mask(t, window, hidden_states.dtype, hidden_states.device)
            hidden_states = layer(hidden_states, position_ids, m)
        return self.norm(hidden_states)


class LlamaForCausalLM(nn.Module):
    # Llama: bias on q/k/v/o only when config.attention_bias. Qwen2 overrides this.
    def _biases(self, cfg):
        b = bool(cfg.get("attention_bias", False))
        return b, b

    def __init__(self, cfg):
        super().__init__()
        self.config = dict(cfg)
        qkv_bias, o_bias = self._biases(cfg)
        self.model = LlamaModel(cfg, qkv_bias, o_bias)
        self.lm_head = nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)  # (vocab, hidden)
        if cfg.get("tie_word_embeddings", False):
            # Same Parameter object: named_parameters() then lists it once, under the
            # embedding's name, and its .grad is the sum of both uses.
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids):
        # input_ids: (B, T) long -> logits (B, T, vocab) in the model dtype
        return self.lm_head(self.model(input_ids))


class Qwen2ForCausalLM(LlamaForCausalLM):
    # Qwen2Attention: q/k/v projections have a bias, o_proj does not.
    def _biases(self, cfg):
        return True, False

    def __init__(self, cfg):
        super().__init__(cfg)


# ----------------------------------------------------------------------------- GPT-2

class Conv1D(nn.Module):
    """GPT-2's transposed linear: weight (in, out), y = x @ W + b."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.empty(nx, nf))  # (in, out)
        self.bias = nn.Parameter(torch.zeros(nf))        # (out,)
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


class GPT2Attention(nn.Module):
    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.embed_dim = cfg["n_embd"]
        self.num_heads = cfg["n_head"]
        self.head_dim = self.embed_dim // self.num_heads
        self.split_size = self.embed_dim
        self.scale_attn_weights = cfg.get("scale_attn_weights", True)
        self.scale_attn_by_inverse_layer_idx = cfg.get("scale_attn_by_inverse_layer_idx", False)
        if cfg.get("reorder_and_upcast_attn", False):
            raise ValueError("reorder_and_upcast_attn is not supported by the parity reference")
        self.layer_idx = layer_idx
        self.c_attn = Conv1D(3 * self.embed_dim, self.embed_dim)  # weight (hidden, 3*hidden)
        self.c_proj = Conv1D(self.embed_dim, self.embed_dim)      # weight (hidden, hidden)

    def _split_heads(self, tensor):
        new_shape = tensor.size()[:-1] + (self.num_heads, self.head_dim)
        return tensor.view(new_shape).permute(0, 2, 1, 3)  # (B, heads, T, d)

    def _attn(self, query, key, value):
        attn_weights = torch.matmul(query, key.transpose(-1, -2))
        if self.scale_attn_weights:
            attn_weights = attn_weights / torch.full(
                [], value.size(-1) ** 0.5, dtype=attn_weights.dtype, device=attn_weights.device)
        if self.scale_attn_by_inverse_layer_idx:
            attn_weights = attn_weights / float(self.layer_idx + 1)
        t = query.size(-2)
        causal_mask = torch.tril(torch.ones((t, t), dtype=torch.bool, device=query.device))[None, None]
        mask_value = torch.full([], torch.finfo(attn_weights.dtype).min, dtype=attn_weights.dtype,
                                device=attn_weights.device)
        attn_weights = torch.where(causal_mask, attn_weights, mask_value)
        # Unlike Llama, GPT-2's eager softmax runs in the scores' dtype (bf16 stays bf16).
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_weights = attn_weights.type(value.dtype)
        return torch.matmul(attn_weights, value)

    def forward(self, hidden_states):
        query, key, value = self.c_attn(hidden_states).split(self.split_size, dim=2)
        query, key, value = self._split_heads(query), self._split_heads(key), self._split_heads(value)
        attn_output = self._attn(query, key, value)
        attn_output = attn_output.permute(0, 2, 1, 3).contiguous()
        attn_output = attn_output.view(attn_output.size()[:-2] + (self.embed_dim,))
        return self.c_proj(attn_output)


class GPT2MLP(nn.Module):
    def __init__(self, intermediate_size, cfg):
        super().__init__()
        self.c_fc = Conv1D(intermediate_size, cfg["n_embd"])    # weight (hidden, inner)
        self.c_proj = Conv1D(cfg["n_embd"], intermediate_size)  # weight (inner, hidden)
        self.act = _activation(cfg.get("activation_function", "gelu_new"))

    def forward(self, hidden_states):
        return self.c_proj(self.act(self.c_fc(hidden_states)))


class GPT2Block(nn.Module):
    def __init__(self, cfg, layer_idx):
        super().__init__()
        hidden = cfg["n_embd"]
        inner = cfg.get("n_inner") or 4 * hidden
        eps = cfg.get("layer_norm_epsilon", 1e-5)
        self.ln_1 = nn.LayerNorm(hidden, eps=eps)
        self.attn = GPT2Attention(cfg, layer_idx)
        self.ln_2 = nn.LayerNorm(hidden, eps=eps)
        self.mlp = GPT2MLP(inner, cfg)

    def forward(self, hidden_states):
        hidden_states = hidden_states + self.attn(self.ln_1(hidden_states))
        return hidden_states + self.mlp(self.ln_2(hidden_states))


class GPT2Model(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.wte = nn.Embedding(cfg["vocab_size"], cfg["n_embd"])   # (vocab, hidden)
        self.wpe = nn.Embedding(cfg["n_positions"], cfg["n_embd"])  # (positions, hidden)
        self.h = nn.ModuleList([GPT2Block(cfg, i) for i in range(cfg["n_layer"])])
        self.ln_f = nn.LayerNorm(cfg["n_embd"], eps=cfg.get("layer_norm_epsilon", 1e-5))

    def forward(self, input_ids):
        t = input_ids.shape[1]
        position_ids = torch.arange(t, dtype=torch.long, device=input_ids.device).unsqueeze(0)
        hidden_states = self.wte(input_ids) + self.wpe(position_ids)
        for block in self.h:
            hidden_states = block(hidden_states)
        return self.ln_f(hidden_states)


class GPT2LMHeadModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = dict(cfg)
        self.transformer = GPT2Model(cfg)
        self.lm_head = nn.Linear(cfg["n_embd"], cfg["vocab_size"], bias=False)
        if cfg.get("tie_word_embeddings", True):
            self.lm_head.weight = self.transformer.wte.weight

    def forward(self, input_ids):
        # input_ids: (B, T) long -> logits (B, T, vocab) in the model dtype
        return self.lm_head(self.transformer(input_ids))


# ----------------------------------------------------------------------------- DeepSeek-V2 / V3

class DeepseekV2MLP(Qwen2MoeMLP):
    """modeling_deepseek.py DeepseekV2MLP: down(act(gate x) * up x); the dense layers use
    intermediate_size, every expert moe_intermediate_size, the shared experts
    moe_intermediate_size * n_shared_experts (one MLP)."""


class DeepseekV2Attention(nn.Module):
    """modeling_deepseek.py DeepseekV2Attention (V2 and V3 remote code, eager path, rope_scaling
    null or yarn), the transcription of mla_reference.attention with HF's dtype handling:
    q = q_proj(x) or q_b_proj(q_a_layernorm(q_a_proj(x))), split per head into q_nope / q_pe;
    kv_a_proj_with_mqa(x) split into the latent c and the one shared rope key k_pe;
    kv_b_proj(kv_a_layernorm(c)) split per head into k_nope / v; DeepSeek's
    apply_rotary_pos_emb (de-interleave, then rotate_half) on q_pe and k_pe; scores
    (q k^T) * (qk_nope + qk_rope)^-0.5, additive causal mask, softmax in f32 cast back;
    o_proj over the heads' v_head_dim outputs. With yarn: DeepseekV2YarnRotaryEmbedding's
    frequencies and cos/sin factor, and the scale times yarn_get_mscale(factor,
    mscale_all_dim)^2 where mscale_all_dim is set."""

    def __init__(self, cfg):
        super().__init__()
        yarn = _deepseek_rope_scaling(cfg)
        if cfg.get("attention_bias", False):
            raise ValueError("attention_bias is not supported by the DeepSeek parity reference")
        h = cfg["hidden_size"]
        eps = cfg["rms_norm_eps"]
        self.num_heads = cfg["num_attention_heads"]
        self.q_lora_rank = cfg.get("q_lora_rank")
        self.kv_lora_rank = cfg["kv_lora_rank"]
        self.qk_nope_head_dim = cfg["qk_nope_head_dim"]
        self.qk_rope_head_dim = cfg["qk_rope_head_dim"]
        self.v_head_dim = cfg["v_head_dim"]
        self.q_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(h, self.num_heads * self.q_head_dim, bias=False)  # (heads*qk, hidden)
        else:
            self.q_a_proj = nn.Linear(h, self.q_lora_rank, bias=False)  # (q_lora, hidden)
            self.q_a_layernorm = LlamaRMSNorm(self.q_lora_rank, eps=eps)
            self.q_b_proj = nn.Linear(self.q_lora_rank, self.num_heads * self.q_head_dim, bias=False)
        # (kv_lora + rope, hidden)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.kv_lora_rank + self.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = LlamaRMSNorm(self.kv_lora_rank, eps=eps)
        # (heads * (nope + v), kv_lora)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.num_heads * (self.qk_nope_head_dim + self.v_head_dim),
                                   bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_head_dim, h, bias=False)  # (hidden, heads*v)
        base = cfg.get("rope_theta", 10000.0)
        if yarn is None:
            # DeepseekV2RotaryEmbedding: the same inv_freq / f32 cos-sin as Llama's, over qk_rope_head_dim.
            self.rotary_emb = LlamaRotaryEmbedding(self.qk_rope_head_dim, base=base)
        else:
            self.rotary_emb = DeepseekV2YarnRotaryEmbedding(self.qk_rope_head_dim, base=base, **yarn)
        self.softmax_scale = self.q_head_dim ** (-0.5)
        if yarn is not None:
            mscale_all_dim = cfg["rope_scaling"].get("mscale_all_dim", 0)
            scaling_factor = cfg["rope_scaling"]["factor"]
            if mscale_all_dim:
                mscale = yarn_get_mscale(scaling_factor, mscale_all_dim)
                self.softmax_scale = self.softmax_scale * mscale * mscale

    def _cos_sin(self, x, seq_len):
        """cos_cached / sin_cached [:seq_len]: (T, rope) computed in f32, cast to x.dtype
        (with yarn: times its mscale, in f32, before the cast)."""
        ct = _upcast_dtype(x.dtype)
        t = torch.arange(seq_len, device=x.device, dtype=ct)
        freqs = torch.outer(t, self.rotary_emb.inv_freq(x.device, ct))
        emb = torch.cat((freqs, freqs), dim=-1)
        if isinstance(self.rotary_emb, DeepseekV2YarnRotaryEmbedding):
            m = self.rotary_emb.mscale
            return (emb.cos() * m).to(x.dtype), (emb.sin() * m).to(x.dtype)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    def forward(self, hidden_states, position_ids, attention_mask):
        bsz, q_len, _ = hidden_states.size()
        if self.q_lora_rank is None:
            q = self.q_proj(hidden_states)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q = q.view(bsz, q_len, self.num_heads, self.q_head_dim).transpose(1, 2)
        q_nope, q_pe = torch.split(q, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)

        compressed_kv = self.kv_a_proj_with_mqa(hidden_states)
        compressed_kv, k_pe = torch.split(compressed_kv, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_pe = k_pe.view(bsz, q_len, 1, self.qk_rope_head_dim).transpose(1, 2)
        kv = (self.kv_b_proj(self.kv_a_layernorm(compressed_kv))
              .view(bsz, q_len, self.num_heads, self.qk_nope_head_dim + self.v_head_dim).transpose(1, 2))
        k_nope, value_states = torch.split(kv, [self.qk_nope_head_dim, self.v_head_dim], dim=-1)

        cos, sin = self._cos_sin(value_states, q_len)
        q_pe, k_pe = mla_reference.apply_rotary_pos_emb(q_pe, k_pe, cos, sin, position_ids)

        query_states = torch.cat([q_nope, q_pe], dim=-1)
        key_states = torch.cat([k_nope, k_pe.expand(-1, self.num_heads, -1, -1)], dim=-1)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.softmax_scale
        attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=_upcast_dtype(attn_weights.dtype)).to(query_states.dtype)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).contiguous().reshape(bsz, q_len, self.num_heads * self.v_head_dim)
        return self.o_proj(attn_output)


class DeepseekV2MoEGate(nn.Module):
    """modeling_deepseek.py MoEGate's routing (its training-only auxiliary loss, when
    aux_loss_alpha > 0, is DeepseekV2MoE's last_aux, through moe_reference.deepseek_v2_aux).
    Logits in f32 (F.linear of both operands cast
    to f32), choice through moe_reference.deepseek_gate:
      V2 (topk_method greedy | group_limited_greedy, group score = best expert): weights
         renormalised when top_k > 1 and norm_topk_prob, otherwise times routed_scaling_factor;
      V3 (noaux_tc, group score = sum of the two best, chosen on scores +
         e_score_correction_bias, weighted by the unbiased scores): renormalised when
         top_k > 1 and norm_topk_prob, then always times routed_scaling_factor.
    The remote code's renormalisation denominator carries a + 1e-20: a no-op for sums of
    softmax / sigmoid scores (far above 1e-13) in f32 and f64, so deepseek_gate's plain sum
    gives the same bits."""

    def __init__(self, cfg):
        super().__init__()
        self.top_k = cfg["num_experts_per_tok"]
        self.n_routed_experts = cfg["n_routed_experts"]
        self.routed_scaling_factor = float(cfg.get("routed_scaling_factor", 1.0))
        self.scoring_func = cfg.get("scoring_func", "softmax")
        self.topk_method = cfg.get("topk_method", "greedy")
        self.n_group = cfg.get("n_group") or 1
        self.topk_group = cfg.get("topk_group") or 1
        self.norm_topk_prob = bool(cfg.get("norm_topk_prob", False))
        if self.scoring_func not in ("softmax", "sigmoid"):
            raise ValueError(f"unsupported scoring_func '{self.scoring_func}'")
        if self.topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise ValueError(f"unsupported topk_method '{self.topk_method}'")
        if self.topk_method != "greedy" and self.n_routed_experts % self.n_group != 0:
            raise ValueError("n_routed_experts must be a multiple of n_group")
        self.weight = nn.Parameter(torch.empty(self.n_routed_experts, cfg["hidden_size"]))  # (E, hidden)
        if self.topk_method == "noaux_tc":
            # A Parameter in the V3 remote code (so a checkpoint key), never trained by backprop.
            self.e_score_correction_bias = nn.Parameter(torch.zeros(self.n_routed_experts), requires_grad=False)

    def forward(self, hidden_states):
        """hidden_states (N, hidden) -> selected (N, top_k) long, weights (N, top_k) in f32
        (f64 for an f64 model)."""
        ct = _upcast_dtype(hidden_states.dtype)
        logits = F.linear(hidden_states.to(ct), self.weight.to(ct), None)
        noaux = self.topk_method == "noaux_tc"
        normalise = self.top_k > 1 and self.norm_topk_prob
        scaling = self.routed_scaling_factor if (noaux or not normalise) else 1.0
        bias = self.e_score_correction_bias.to(ct) if noaux else None
        return moe_reference.deepseek_gate(
            logits, self.top_k, normalise, bias, self.scoring_func,
            1 if self.topk_method == "greedy" else self.n_group, self.topk_group,
            "top2" if noaux else "max", scaling)


class DeepseekV2MoE(nn.Module):
    """modeling_deepseek.py DeepseekV2MoE: every expert over the (token, choice) slots routed
    to it, the top_k outputs weighted in the gate weights' dtype (f32) and summed there,
    cast back to the model dtype (as both its training path and moe_infer do), plus
    shared_experts(x)."""

    def __init__(self, cfg):
        super().__init__()
        self.num_experts_per_tok = cfg["num_experts_per_tok"]
        self.experts = nn.ModuleList([DeepseekV2MLP(cfg, cfg["moe_intermediate_size"])
                                      for _ in range(cfg["n_routed_experts"])])
        self.gate = DeepseekV2MoEGate(cfg)
        # DeepSeek-V2's MoEGate adds alpha x its balancing loss in training (V3's code has none).
        self.aux_alpha = float(cfg.get("aux_loss_alpha") or 0.0) if cfg["model_type"] == "deepseek_v2" else 0.0
        self.seq_aux = bool(cfg.get("seq_aux", True))
        if cfg.get("n_shared_experts"):
            self.shared_experts = DeepseekV2MLP(cfg, cfg["moe_intermediate_size"] * cfg["n_shared_experts"])

    def forward(self, hidden_states):
        identity = hidden_states
        orig_shape = hidden_states.shape
        x = hidden_states.reshape(-1, orig_shape[-1])
        topk_idx, topk_weight = self.gate(x)
        self.last_topk_idx = topk_idx.detach()  # the routing, for the reference (make_reference.py)
        if self.aux_alpha > 0:  # MoEGate.forward's training branch (its scores: f32 softmax of the logits)
            scores = F.linear(x.to(torch.float32), self.gate.weight.to(torch.float32), None).softmax(dim=-1)
            self.last_aux = moe_reference.deepseek_v2_aux(scores, topk_idx, self.aux_alpha, orig_shape[0], self.seq_aux,
                                                          self.gate.n_routed_experts, self.gate.top_k)
        flat_topk_idx = topk_idx.reshape(-1)
        xr = x.repeat_interleave(self.num_experts_per_tok, dim=0)  # slot s = token s // k, choice s % k
        y = torch.zeros_like(xr)
        for i, expert in enumerate(self.experts):
            slots = torch.nonzero(flat_topk_idx == i).squeeze(1)
            if slots.numel():
                y = y.index_copy(0, slots, expert(xr[slots]))
        y = (y.view(*topk_weight.shape, -1).to(topk_weight.dtype) * topk_weight.unsqueeze(-1)).sum(dim=1)
        y = y.to(x.dtype).view(*orig_shape)
        if hasattr(self, "shared_experts"):
            y = y + self.shared_experts(identity)
        return y


def _deepseek_is_moe_layer(cfg, layer_idx):
    return (cfg.get("n_routed_experts") is not None and layer_idx >= cfg.get("first_k_dense_replace", 0)
            and layer_idx % cfg.get("moe_layer_freq", 1) == 0)


class DeepseekV2DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.self_attn = DeepseekV2Attention(cfg)
        if _deepseek_is_moe_layer(cfg, layer_idx):
            self.mlp = DeepseekV2MoE(cfg)
        else:
            self.mlp = DeepseekV2MLP(cfg, cfg["intermediate_size"])
        self.input_layernorm = LlamaRMSNorm(cfg["hidden_size"], eps=cfg["rms_norm_eps"])
        self.post_attention_layernorm = LlamaRMSNorm(cfg["hidden_size"], eps=cfg["rms_norm_eps"])

    def forward(self, hidden_states, position_ids, attention_mask):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = self.self_attn(hidden_states, position_ids, attention_mask)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        return residual + hidden_states


class _SharedHead(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.norm = LlamaRMSNorm(cfg["hidden_size"], eps=cfg["rms_norm_eps"])


class DeepseekV3MTPLayer(DeepseekV2DecoderLayer):
    """DeepSeek-V3's multi-token-prediction module, stored as model.layers.{num_hidden_layers}
    (checkpoint layout): a full decoder layer plus enorm, hnorm, eh_proj (hidden, 2 hidden)
    and shared_head.norm. Its embedding and output head are the main model's. Predicts, at
    position i, token i + 2 from the main model's final (normed) hidden state at i and the
    embedding of token i + 1 (vLLM deepseek_mtp.py / Megatron order: embedding half first)."""

    def __init__(self, cfg, layer_idx):
        super().__init__(cfg, layer_idx)
        h = cfg["hidden_size"]
        self.enorm = LlamaRMSNorm(h, eps=cfg["rms_norm_eps"])
        self.hnorm = LlamaRMSNorm(h, eps=cfg["rms_norm_eps"])
        self.eh_proj = nn.Linear(2 * h, h, bias=False)  # (hidden, 2 hidden)
        self.shared_head = _SharedHead(cfg)

    def mtp_forward(self, input_ids, main_hidden, embed_tokens, lm_head):
        """input_ids (B, T), main_hidden (B, T, hidden) after model.norm -> mtp logits (B, T, V)."""
        bsz, t = input_ids.shape
        mtp_ids = torch.zeros_like(input_ids)
        mtp_ids[:, :-1] = input_ids[:, 1:]
        x = self.eh_proj(torch.cat([self.enorm(embed_tokens(mtp_ids)), self.hnorm(main_hidden)], dim=-1))
        position_ids = torch.arange(t, device=input_ids.device).unsqueeze(0).expand(bsz, t)
        mask = _causal_additive_mask(t, x.dtype, x.device)
        x = super().forward(x, position_ids, mask)  # the decoder layer, residuals inside
        return lm_head(self.shared_head.norm(x))


def mtp_targets(targets):
    """targets (B, T) -> MTP targets: targets[:, i + 1] for i < T-1, -100 at T-1."""
    out = torch.full_like(targets, -100)
    out[:, :-1] = targets[:, 1:]
    return out


class DeepseekV2Model(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.num_hidden_layers = cfg["num_hidden_layers"]
        n_mtp = cfg.get("num_nextn_predict_layers") or 0
        if n_mtp not in (0, 1):
            raise ValueError("num_nextn_predict_layers must be 0 or 1 in the parity reference")
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])  # (vocab, hidden)
        layers = [DeepseekV2DecoderLayer(cfg, i) for i in range(self.num_hidden_layers)]
        if n_mtp:
            layers.append(DeepseekV3MTPLayer(cfg, self.num_hidden_layers))
        self.layers = nn.ModuleList(layers)
        self.norm = LlamaRMSNorm(cfg["hidden_size"], eps=cfg["rms_norm_eps"])

    def forward(self, input_ids):
        bsz, t = input_ids.shape
        hidden_states = self.embed_tokens(input_ids)
        position_ids = torch.arange(t, device=input_ids.device).unsqueeze(0).expand(bsz, t)
        mask = _causal_additive_mask(t, hidden_states.dtype, hidden_states.device)
        for layer in self.layers[:self.num_hidden_layers]:
            hidden_states = layer(hidden_states, position_ids, mask)
        return self.norm(hidden_states)


class DeepseekV2ForCausalLM(nn.Module):
    """DeepSeek-V2 (model_type deepseek_v2) and DeepSeek-V3 (deepseek_v3): MLA attention,
    dense MLPs in the first first_k_dense_replace layers, then (every moe_layer_freq-th
    layer) routed + shared experts; V3 checkpoints add the MTP module (forward_mtp)."""

    def __init__(self, cfg):
        super().__init__()
        self.config = dict(cfg)
        self.model = DeepseekV2Model(cfg)
        self.lm_head = nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)  # (vocab, hidden)
        if cfg.get("tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def has_mtp(self):
        return len(self.model.layers) > self.model.num_hidden_layers

    def forward(self, input_ids):
        # input_ids: (B, T) long -> logits (B, T, vocab) in the model dtype (main model only)
        return self.lm_head(self.model(input_ids))

    def forward_mtp(self, input_ids):
        """-> (logits, mtp_logits), both (B, T, vocab); mtp_logits[:, i] predicts token i + 2."""
        hidden = self.model(input_ids)
        mtp = self.model.layers[self.model.num_hidden_layers]
        return self.lm_head(hidden), mtp.mtp_forward(input_ids, hidden, self.model.embed_tokens, self.lm_head)

    def checkpoint_copies(self):
        """{extra checkpoint key: parameter it copies}: DeepSeek-V3 checkpoints store the MTP
        module's (shared) embedding and head again under its own layer."""
        if not self.has_mtp:
            return {}
        p = f"model.layers.{self.model.num_hidden_layers}."
        head = "model.embed_tokens.weight" if self.config.get("tie_word_embeddings", False) else "lm_head.weight"
        return {p + "embed_tokens.weight": "model.embed_tokens.weight", p + "shared_head.head.weight": head}


# ----------------------------------------------------------------------------- building / loading

# ----------------------------------------------------------------------------- Gemma 2

class Gemma2RMSNorm(nn.Module):
    """modeling_gemma2.py Gemma2RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + weight), in f32,
    cast back (the weight is stored as an offset from 1, zero-initialised)."""

    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        ct = _upcast_dtype(x.dtype)
        xf = x.to(ct)
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.to(ct))).to(x.dtype)


class Gemma2Attention(nn.Module):
    """Gemma2Attention (eager): scores scaled by query_pre_attn_scalar^-0.5, soft-capped by
    attn_logit_softcapping (s -> cap tanh(s / cap)) before the mask; even layers attend to a
    sliding window."""

    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.hidden_size = cfg["hidden_size"]
        self.num_heads = cfg["num_attention_heads"]
        self.head_dim = cfg.get("head_dim") or self.hidden_size // self.num_heads
        self.num_key_value_heads = cfg.get("num_key_value_heads") or self.num_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        bias = bool(cfg.get("attention_bias", False))
        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=bias)
        self.scaling = cfg["query_pre_attn_scalar"] ** -0.5
        self.softcap = cfg.get("attn_logit_softcapping")
        self.rotary_emb = rotary_embedding(cfg, self.head_dim)

    def forward(self, hidden_states, position_ids, attention_mask):
        bsz, q_len, _ = hidden_states.size()
        q = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary_emb(v, position_ids)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k = repeat_kv(k, self.num_key_value_groups)
        v = repeat_kv(v, self.num_key_value_groups)
        w = torch.matmul(q, k.transpose(2, 3)) * self.scaling
        if self.softcap is not None:
            w = torch.tanh(w / self.softcap) * self.softcap
        w = w + attention_mask
        w = F.softmax(w, dim=-1, dtype=_upcast_dtype(w.dtype)).to(q.dtype)
        out = torch.matmul(w, v).transpose(1, 2).reshape(bsz, q_len, self.num_heads * self.head_dim)
        return self.o_proj(out)


class Gemma2MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        h, f = cfg["hidden_size"], cfg["intermediate_size"]
        self.gate_proj = nn.Linear(h, f, bias=False)
        self.up_proj = nn.Linear(h, f, bias=False)
        self.down_proj = nn.Linear(f, h, bias=False)
        self.act_fn = _activation(cfg.get("hidden_activation") or "gelu_pytorch_tanh")

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Gemma2DecoderLayer(nn.Module):
    """Pre- and post-norms around both halves: h + post_attn(attn(input(h))), then
    h + post_ffw(mlp(pre_ffw(h)))."""

    def __init__(self, cfg, layer_idx):
        super().__init__()
        eps = cfg["rms_norm_eps"]
        self.self_attn = Gemma2Attention(cfg, layer_idx)
        self.mlp = Gemma2MLP(cfg)
        self.input_layernorm = Gemma2RMSNorm(cfg["hidden_size"], eps)
        self.post_attention_layernorm = Gemma2RMSNorm(cfg["hidden_size"], eps)
        self.pre_feedforward_layernorm = Gemma2RMSNorm(cfg["hidden_size"], eps)
        self.post_feedforward_layernorm = Gemma2RMSNorm(cfg["hidden_size"], eps)

    def forward(self, h, position_ids, mask):
        h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), position_ids, mask))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Gemma2Model(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList([Gemma2DecoderLayer(cfg, i) for i in range(cfg["num_hidden_layers"])])
        self.norm = Gemma2RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.windows = [cfg.get("sliding_window") or 0 if i % 2 == 0 else 0 for i in range(cfg["num_hidden_layers"])]

    def forward(self, input_ids):
        bsz, t = input_ids.shape
        h = self.embed_tokens(input_ids)
        # sqrt(hidden) as a tensor of the hidden states' dtype (rounded in bf16), as transformers
        h = h * torch.tensor(self.cfg["hidden_size"] ** 0.5, dtype=h.dtype)
        position_ids = torch.arange(t, device=input_ids.device).unsqueeze(0).expand(bsz, t)
        full = _causal_additive_mask(t, h.dtype, h.device)
        for layer, window in zip(self.layers, self.windows):
            m = full if window == 0 else _sliding_additive_mask(t, window, h.dtype, h.device)
            h = layer(h, position_ids, m)
        return self.norm(h)


class Gemma2ForCausalLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = dict(cfg)
        self.model = Gemma2Model(cfg)
        self.lm_head = nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)
        if cfg.get("tie_word_embeddings", True):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids):
        logits = self.lm_head(self.model(input_ids))
        cap = self.config.get("final_logit_softcapping")
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits


MODEL_CLASSES = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM, "gpt2": GPT2LMHeadModel,
                 "mistral": LlamaForCausalLM,  # (Llama with sliding-window attention)
                 "qwen3": LlamaForCausalLM,  # (q/k RMSNorm per head, bias as attention_bias)
                 "gemma2": Gemma2ForCausalLM,
                 "mixtral": LlamaForCausalLM,  # (Mixtral: Llama attention, sparse MoE MLP)
                 "qwen2_moe": Qwen2ForCausalLM,  # (Qwen2 attention, experts + shared expert)
                 "deepseek_v2": DeepseekV2ForCausalLM,  # (MLA attention, DeepSeek MoE)
                 "deepseek_v3": DeepseekV2ForCausalLM}  # (same, noaux_tc gate, MTP module)


def build_model(cfg):
    """Model for a HF config dict (as read from config.json), chosen by cfg["model_type"]."""
    model_type = cfg.get("model_type")
    if model_type not in MODEL_CLASSES:
        raise ValueError(f"config.json model_type '{model_type}' is not one of {sorted(MODEL_CLASSES)}")
    return MODEL_CLASSES[model_type](cfg)


def load_model_dir(path):
    """The model of a Hugging Face directory: config.json built, model.safetensors loaded."""
    with open(os.path.join(path, "config.json")) as f:
        model = build_model(json.load(f))
    load_weights(model, safetensors_io.load_file(os.path.join(path, "model.safetensors")))
    return model


def saved_state(model):
    """{HF name: tensor} as save_pretrained writes it: tied lm_head.weight left out; plus the
    copies a checkpoint keeps of shared tensors (DeepSeek-V3's MTP embedding and head)."""
    state = {name: p.detach() for name, p in model.named_parameters()}
    copies = model.checkpoint_copies() if hasattr(model, "checkpoint_copies") else {}
    for name, source in copies.items():
        state[name] = state[source].clone()
    return state


def load_weights(model, tensors):
    """Copies {HF name: tensor} into the model; every parameter must be present, nothing extra.

    A tied lm_head.weight in the file (some checkpoints keep it) must equal the embedding."""
    params = dict(model.named_parameters())  # a tied lm_head.weight is not listed here
    extra = set(tensors) - set(params)
    if "lm_head.weight" in extra:
        emb_name = next(iter(params))  # the embedding is registered first in every model here
        if torch.equal(tensors["lm_head.weight"], tensors.get(emb_name, torch.empty(0))):
            extra.discard("lm_head.weight")
    copies = model.checkpoint_copies() if hasattr(model, "checkpoint_copies") else {}
    for name, source in copies.items():  # stored copies of a shared tensor must equal it
        if name in extra and torch.equal(tensors[name], tensors.get(source, torch.empty(0))):
            extra.discard(name)
    missing = set(params) - set(tensors)
    if missing or extra:
        raise ValueError(f"weights mismatch: missing {sorted(missing)}, unexpected {sorted(extra)}")
    with torch.no_grad():
        for name, p in params.items():
            src = tensors[name]
            if tuple(src.shape) != tuple(p.shape):
                raise ValueError(f"tensor '{name}' has shape {tuple(src.shape)}, model wants {tuple(p.shape)}")
            p.copy_(src.to(p.dtype))
