// Params allocation and the Hugging Face name mapping.
#include "tessera/model/params.h"

#include <utility>

namespace tessera::model {

std::string hf_prefix(const ModelConfig& c) {
  return c.arch == Arch::kGpt2 ? "transformer." : "model.";
}

std::string embedding_name(const ModelConfig& c) {
  return hf_prefix(c) + (c.arch == Arch::kGpt2 ? "wte.weight" : "embed_tokens.weight");
}

std::vector<LinearModule> linear_modules(const ModelConfig& c, int64_t layer, int which) {
  TESSERA_CHECK(layer >= 0 && layer < c.num_layers && which >= 0 && which < 4,
                "linear_modules: layer ", layer, " linear ", which, " out of range");
  const std::string pre = hf_prefix(c), l = std::to_string(layer);
  const int64_t Q = c.q_dim(), KV = c.kv_dim(), H = c.hidden_size, F = c.intermediate_size;
  if (c.arch == Arch::kGpt2) {
    const std::string h = pre + "h." + l + ".";
    switch (which) {
      case 0: return {{h + "attn.c_attn", Q + 2 * KV}};
      case 1: return {{h + "attn.c_proj", H}};
      case 2: return {{h + "mlp.c_fc", F}};
      default: return {{h + "mlp.c_proj", H}};
    }
  }
  const std::string b = pre + "layers." + l + ".";
  switch (which) {
    case 0: return {{b + "self_attn.q_proj", Q}, {b + "self_attn.k_proj", KV}, {b + "self_attn.v_proj", KV}};
    case 1: return {{b + "self_attn.o_proj", H}};
    case 2: return {{b + "mlp.gate_proj", F}, {b + "mlp.up_proj", F}};
    default: return {{b + "mlp.down_proj", H}};
  }
}

namespace {
std::pair<std::string, std::string> mtp_copy_names(const ModelConfig& c) {
  const std::string m = hf_prefix(c) + "layers." + std::to_string(c.num_layers) + ".";
  return {m + "embed_tokens.weight", m + "shared_head.head.weight"};
}
}  // namespace

void add_mtp_shared_copies(const ModelConfig& c, std::vector<std::pair<std::string, Tensor>>& tensors) {
  if (c.mtp_layers == 0) return;
  const auto [embed_copy, head_copy] = mtp_copy_names(c);
  Tensor embed, head;
  for (const auto& [name, t] : tensors) {
    if (name == embedding_name(c)) embed = t;
    if (name == "lm_head.weight") head = t;
  }
  if (!head.defined()) head = embed;  // tied
  if (embed.defined()) tensors.emplace_back(embed_copy, embed);
  if (head.defined()) tensors.emplace_back(head_copy, head);
}

bool is_mtp_shared_copy(const ModelConfig& c, const std::string& name) {
  if (c.mtp_layers == 0) return false;
  const auto [embed_copy, head_copy] = mtp_copy_names(c);
  return name == embed_copy || name == head_copy;
}

Params Params::allocate(const ModelConfig& c, DType dt) {
  return allocate(c, dt, local_dims(c, TpShard{}));
}

Params Params::allocate_frozen(const ModelConfig& c) {
  Params p = allocate(c, DType::kF32, local_dims(c, TpShard{}), /*zeroed=*/false);
  p.embed = p.pos_embed = p.lm_head = Tensor();
  for (auto& L : p.layers)
    for (Linear* lin : {&L.qkv, &L.o, &L.up, &L.down}) lin->weight = lin->bias = Tensor();
  p.zero();
  return p;
}

Params Params::allocate(const ModelConfig& c, DType dt, const LocalDims& d, bool zeroed,
                        const PpStage& stage) {
  const auto make = [&](const Shape& shape) {
    return zeroed ? Tensor::zeros(shape, dt) : Tensor::empty(shape, dt);
  };
  const int64_t H = c.hidden_size, F = d.ffn;
  Params p;
  if (stage.holds_embed()) {
    p.embed = make({d.vocab, H});
    if (c.arch == Arch::kGpt2) p.pos_embed = make({c.max_position_embeddings, H});
  }
  const bool ln = c.uses_layernorm();
  p.layers.resize(c.num_layers + c.mtp_layers);
  for (int64_t l = 0; l < c.num_layers + c.mtp_layers; ++l) {
    auto& L = p.layers[l];
    if (c.arch == Arch::kGpt2) L.qkv.in_out = L.o.in_out = L.up.in_out = L.down.in_out = true;
    // (The multi-token prediction layer sits with the head.)
    if (l < c.num_layers ? !stage.holds_layer(l) : !stage.holds_head()) continue;
    L.norm1_w = make({H});
    L.norm2_w = make({H});
    if (c.sandwich_norms) {
      L.post_attn_norm = make({H});
      L.post_mlp_norm = make({H});
    }
    if (ln) {
      L.norm1_b = make({H});
      L.norm2_b = make({H});
    }
    if (c.arch == Arch::kGpt2) {
      L.qkv.weight = make({H, d.qkv});
      L.o.weight = make({d.q, H});
      L.up.weight = make({H, F});
      L.down.weight = make({F, H});
      L.qkv.bias = make({d.qkv});
      L.o.bias = make({H});
      L.up.bias = make({F});
      L.down.bias = make({H});
      continue;
    }
    if (c.uses_mla()) {  // (f32 always: the latent attention multiplies in f32)
      MlaWeights& A = L.mla;
      const auto f32 = [&](const Shape& shape) { return zeroed ? Tensor::zeros(shape, DType::kF32) : Tensor::empty(shape, DType::kF32); };
      const int64_t heads = d.heads, qk = heads * c.head_dim;  // (this rank's heads under tp)
      if (c.q_lora_rank > 0) {
        A.q_a = f32({c.q_lora_rank, H});
        A.q_a_norm = f32({c.q_lora_rank});
        A.q_b = f32({qk, c.q_lora_rank});
      } else {
        A.q_proj = f32({qk, H});
      }
      A.kv_a = f32({c.kv_lora_rank + c.qk_rope_head_dim, H});
      A.kv_a_norm = f32({c.kv_lora_rank});
      A.kv_b = f32({heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank});
      A.o = f32({H, heads * c.v_head_dim});
    } else {
      L.qkv.weight = make({d.qkv, H});
      L.o.weight = make({H, d.q});
      if (c.qkv_bias) L.qkv.bias = make({d.qkv});
      if (c.qk_norm) {
        L.q_norm = make({c.head_dim});
        L.k_norm = make({c.head_dim});
      }
    }
    if (c.layer_is_moe(l)) {
      const int64_t Fe = c.moe_intermediate_size;
      L.moe.router = make({c.num_experts, H});
      L.moe.gate_up = make({d.experts, 2 * Fe, H});
      L.moe.down = make({d.experts, H, Fe});
      if (c.shared_expert) L.moe.shared_gate = make({1, H});
      if (c.router_bias) L.moe.bias = Tensor::zeros({c.num_experts}, DType::kF32);  // (selection only: f32)
    }
    // The dense MLP, or a MoE layer's shared expert(s) (qwen2_moe, deepseek).
    const int64_t Fl = c.is_deepseek() ? c.mlp_size(l) * d.heads / c.num_heads : F;  // (/ tp)
    if (Fl > 0 && (!c.layer_is_moe(l) || c.shared_expert || c.is_deepseek())) {
      L.up.weight = make({2 * Fl, H});
      L.down.weight = make({H, Fl});
    }
  }
  if (c.mtp_layers > 0 && stage.holds_head()) {
    p.mtp.enorm = make({H});
    p.mtp.hnorm = make({H});
    p.mtp.eh_proj = make({H, 2 * H});
    p.mtp.head_norm = make({H});
  }
  if (!stage.holds_head()) return p;
  p.final_norm_w = make({H});
  if (ln) p.final_norm_b = make({H});
  // A tied head on a pipeline stage without the embeddings is a copy of them, kept equal
  // by summing the two gradients between the first and last stage (as Megatron-LM does).
  p.lm_head = c.tie_word_embeddings && p.embed.defined() ? p.embed : make({d.vocab, H});
  return p;
}

Tensor Piece::block_of(const Tensor& t) const {
  TESSERA_CHECK(t.shape() == full, "tensor '", name, "' has shape ", shape_str(t.shape()),
                ", expected ", shape_str(full));
  Tensor b = t;
  for (int64_t dim = 0; dim < view.dim(); ++dim)
    if (view.size(dim) != full[dim]) b = b.slice(dim, offset[dim], offset[dim] + view.size(dim));
  return b;
}

std::vector<std::pair<std::string, Tensor>> Params::named(const ModelConfig& c) const {
  TESSERA_CHECK(!embed.defined() || embed.size(0) == c.vocab_size, "Params::named: a tensor-parallel shard has "
                "pieces, not whole tensors");
  for (const auto& L : layers)
    TESSERA_CHECK(!L.moe.gate_up.defined() || L.moe.gate_up.size(0) == c.num_experts,
                  "Params::named: an expert-parallel shard holds ", L.moe.gate_up.size(0), " of the ",
                  c.num_experts, " experts, not the whole model");
  std::vector<std::pair<std::string, Tensor>> out;
  for (auto& p : pieces(c, TpShard{})) out.emplace_back(std::move(p.name), std::move(p.view));
  return out;
}

std::vector<Piece> Params::pieces(const ModelConfig& c, TpShard shard) const {
  const LocalDims d = local_dims(c, shard);
  const int64_t r = shard.rank, H = c.hidden_size, V = c.vocab_size;
  const int64_t Q = c.q_dim(), KV = c.kv_dim();
  std::vector<Piece> out;
  // A block of `full` at `offset`; a replicated tensor is its whole self.
  auto add = [&](const std::string& name, const Tensor& t, Shape full, std::vector<int64_t> off,
                 int64_t copies = 1) {
    if (!t.defined()) return;
    int block = 0;
    for (const Piece& p : out) block += p.name == name;
    out.push_back(Piece{name, t, std::move(full), std::move(off), copies, block});
  };
  auto whole = [&](const std::string& name, const Tensor& t) {
    if (t.defined()) add(name, t, t.shape(), std::vector<int64_t>(t.dim(), 0), shard.size);
  };
  const int64_t kvr = d.kv_replicas, kvi = d.kv_index;  // the kv block and its copies
  // Rows [a, b) of t; nothing for an undefined t (a quantized linear has no float weight).
  auto rows = [](const Tensor& t, int64_t a, int64_t b) { return t.defined() ? t.slice(0, a, b) : Tensor(); };
  const std::string pre = hf_prefix(c);
  if (c.arch == Arch::kGpt2) {
    add(pre + "wte.weight", embed, {V, H}, {d.vocab_begin, 0});
    whole(pre + "wpe.weight", pos_embed);
    for (size_t i = 0; i < layers.size(); ++i) {
      const auto& L = layers[i];
      if (!L.norm1_w.defined()) continue;  // another pipeline stage's layer
      const std::string h = pre + "h." + std::to_string(i) + ".";
      whole(h + "ln_1.weight", L.norm1_w);
      whole(h + "ln_1.bias", L.norm1_b);
      // c_attn (H, Q + 2 KV) in_out: this rank's q, k and v columns.
      if (shard.size == 1) {
        whole(h + "attn.c_attn.weight", L.qkv.weight);
        whole(h + "attn.c_attn.bias", L.qkv.bias);
      } else {
        const int64_t begin[] = {0, d.q, d.q + d.kv}, width[] = {d.q, d.kv, d.kv};
        const int64_t at[] = {r * d.q, Q + kvi * d.kv, Q + KV + kvi * d.kv};
        for (int j = 0; j < 3; ++j) {
          const int64_t copies = j == 0 ? 1 : kvr;
          add(h + "attn.c_attn.weight", L.qkv.weight.slice(1, begin[j], begin[j] + width[j]),
              {H, Q + 2 * KV}, {0, at[j]}, copies);
          add(h + "attn.c_attn.bias", L.qkv.bias.slice(0, begin[j], begin[j] + width[j]),
              {Q + 2 * KV}, {at[j]}, copies);
        }
      }
      add(h + "attn.c_proj.weight", L.o.weight, {Q, H}, {r * d.q, 0});
      whole(h + "attn.c_proj.bias", L.o.bias);
      whole(h + "ln_2.weight", L.norm2_w);
      whole(h + "ln_2.bias", L.norm2_b);
      const int64_t F = c.intermediate_size, Fl = d.ffn;
      add(h + "mlp.c_fc.weight", L.up.weight, {H, F}, {0, r * Fl});
      add(h + "mlp.c_fc.bias", L.up.bias, {F}, {r * Fl});
      add(h + "mlp.c_proj.weight", L.down.weight, {F, H}, {r * Fl, 0});
      whole(h + "mlp.c_proj.bias", L.down.bias);
    }
    whole(pre + "ln_f.weight", final_norm_w);  // (whole() skips what a stage lacks)
    whole(pre + "ln_f.bias", final_norm_b);
    if (!embed.defined()) add("lm_head.weight", lm_head, {V, H}, {d.vocab_begin, 0});  // tied copy
    return out;
  }
  add(pre + "embed_tokens.weight", embed, {V, H}, {d.vocab_begin, 0});
  for (size_t i = 0; i < layers.size(); ++i) {
    const auto& L = layers[i];
    if (!L.norm1_w.defined()) continue;  // another pipeline stage's layer
    const std::string l = pre + "layers." + std::to_string(i) + ".";
    whole(l + "input_layernorm.weight", L.norm1_w);
    add(l + "self_attn.q_proj.weight", rows(L.qkv.weight, 0, d.q), {Q, H}, {r * d.q, 0});
    add(l + "self_attn.k_proj.weight", rows(L.qkv.weight, d.q, d.q + d.kv), {KV, H},
        {kvi * d.kv, 0}, kvr);
    add(l + "self_attn.v_proj.weight", rows(L.qkv.weight, d.q + d.kv, d.qkv), {KV, H},
        {kvi * d.kv, 0}, kvr);
    if (L.qkv.bias.defined()) {
      add(l + "self_attn.q_proj.bias", L.qkv.bias.slice(0, 0, d.q), {Q}, {r * d.q});
      add(l + "self_attn.k_proj.bias", L.qkv.bias.slice(0, d.q, d.q + d.kv), {KV}, {kvi * d.kv}, kvr);
      add(l + "self_attn.v_proj.bias", L.qkv.bias.slice(0, d.q + d.kv, d.qkv), {KV}, {kvi * d.kv},
          kvr);
    }
    add(l + "self_attn.o_proj.weight", L.o.weight, {H, Q}, {0, r * d.q});
    whole(l + "self_attn.q_norm.weight", L.q_norm);  // (qwen3; replicated over tp)
    whole(l + "self_attn.k_norm.weight", L.k_norm);
    if (c.uses_mla()) {  // deepseek's latent attention: heads split over tp, the latents replicated
      const std::string a = l + "self_attn.";
      const int64_t qk = c.head_dim, nv = c.qk_nope_head_dim + c.v_head_dim, hl = d.heads, Hq = c.num_heads;
      add(a + "q_proj.weight", L.mla.q_proj, {Hq * qk, H}, {r * hl * qk, 0});
      whole(a + "q_a_proj.weight", L.mla.q_a);
      whole(a + "q_a_layernorm.weight", L.mla.q_a_norm);
      if (L.mla.q_b.defined())
        add(a + "q_b_proj.weight", L.mla.q_b, {Hq * qk, c.q_lora_rank}, {r * hl * qk, 0});
      whole(a + "kv_a_proj_with_mqa.weight", L.mla.kv_a);
      whole(a + "kv_a_layernorm.weight", L.mla.kv_a_norm);
      add(a + "kv_b_proj.weight", L.mla.kv_b, {Hq * nv, c.kv_lora_rank}, {r * hl * nv, 0});
      add(a + "o_proj.weight", L.mla.o, {H, Hq * c.v_head_dim}, {0, r * hl * c.v_head_dim});
    }
    if (c.sandwich_norms) {  // gemma2: post_attention_layernorm follows the attention
      whole(l + "post_attention_layernorm.weight", L.post_attn_norm);
      whole(l + "pre_feedforward_layernorm.weight", L.norm2_w);
      whole(l + "post_feedforward_layernorm.weight", L.post_mlp_norm);
    } else {
      whole(l + "post_attention_layernorm.weight", L.norm2_w);
    }
    // The dense MLP (qwen2_moe: the shared expert, under mlp.shared_expert; deepseek: the
    // shared experts, under mlp.shared_experts).
    const bool sparse = c.layer_is_moe(static_cast<int64_t>(i));
    const std::string mlp = l + (!sparse ? "mlp." : c.shared_expert ? "mlp.shared_expert." : "mlp.shared_experts.");
    const int64_t F = c.mlp_size(static_cast<int64_t>(i)), Fl = c.is_deepseek() ? F / shard.size : d.ffn;
    add(mlp + "gate_proj.weight", rows(L.up.weight, 0, Fl), {F, H}, {r * Fl, 0});
    add(mlp + "up_proj.weight", rows(L.up.weight, Fl, 2 * Fl), {F, H}, {r * Fl, 0});
    add(mlp + "down_proj.weight", L.down.weight, {H, F}, {0, r * Fl});
    if (L.moe.router.defined()) {  // transformers' names (tp = 1: every expert whole)
      const int64_t Fe = c.moe_intermediate_size;
      // qwen2_moe, deepseek: mlp.experts.E.gate_proj/up_proj/down_proj
      const bool qwen = c.shared_expert || c.is_deepseek();
      const std::string moe = l + (qwen ? "mlp." : "block_sparse_moe.");
      whole(moe + "gate.weight", L.moe.router);
      for (int64_t i = 0; i < d.experts; ++i) {  // this rank's experts (all of them at ep 1)
        const std::string x = moe + "experts." + std::to_string(d.expert_begin + i) + ".";
        const Tensor gu = L.moe.gate_up.select(0, i);
        whole(x + (qwen ? "gate_proj.weight" : "w1.weight"), gu.slice(0, 0, Fe));
        whole(x + (qwen ? "down_proj.weight" : "w2.weight"), L.moe.down.select(0, i));
        whole(x + (qwen ? "up_proj.weight" : "w3.weight"), gu.slice(0, Fe, 2 * Fe));
      }
      whole(moe + "shared_expert_gate.weight", L.moe.shared_gate);
      whole(moe + "gate.e_score_correction_bias", L.moe.bias);
    }
  }
  if (mtp.enorm.defined()) {  // DeepSeek-V3's multi-token prediction module
    const std::string m = pre + "layers." + std::to_string(c.num_layers) + ".";
    whole(m + "enorm.weight", mtp.enorm);
    whole(m + "hnorm.weight", mtp.hnorm);
    whole(m + "eh_proj.weight", mtp.eh_proj);
    whole(m + "shared_head.norm.weight", mtp.head_norm);
  }
  whole(pre + "norm.weight", final_norm_w);
  if (!c.tie_word_embeddings || !embed.defined())  // (tied: the last stage's copy)
    add("lm_head.weight", lm_head, {V, H}, {d.vocab_begin, 0});
  return out;
}

std::vector<std::pair<std::string, Tensor*>> Params::unit_tensors(const ModelConfig& c, int unit) {
  const int L = static_cast<int>(c.num_layers);
  TESSERA_CHECK(unit >= 0 && unit <= L + 1, "unit_tensors: unit ", unit, " out of range [0, ",
                L + 1, "]");
  std::vector<std::pair<std::string, Tensor*>> out;
  auto add = [&](std::string name, Tensor& t) {
    if (t.defined()) out.emplace_back(std::move(name), &t);
  };
  if (unit == 0) {
    add("embed", embed);
    add("pos_embed", pos_embed);
  }
  // A block's tensors; the multi-token prediction layer's are the head's.
  auto layer = [&](int64_t l) {
    LayerParams& P = layers[l];
    const std::string pre = "layers." + std::to_string(l) + ".";
    add(pre + "norm1.weight", P.norm1_w);
    add(pre + "norm1.bias", P.norm1_b);
    const char* names[] = {"qkv", "o", "up", "down"};
    Linear* lins[] = {&P.qkv, &P.o, &P.up, &P.down};
    for (int i = 0; i < 4; ++i) {
      add(pre + names[i] + ".weight", lins[i]->weight);
      add(pre + names[i] + ".bias", lins[i]->bias);
    }
    add(pre + "norm2.weight", P.norm2_w);
    add(pre + "norm2.bias", P.norm2_b);
    add(pre + "post_attn_norm", P.post_attn_norm);
    add(pre + "post_mlp_norm", P.post_mlp_norm);
    add(pre + "q_norm", P.q_norm);
    add(pre + "k_norm", P.k_norm);
    add(pre + "moe.router", P.moe.router);
    add(pre + "moe.gate_up", P.moe.gate_up);
    add(pre + "moe.down", P.moe.down);
    add(pre + "moe.shared_gate", P.moe.shared_gate);
    add(pre + "moe.bias", P.moe.bias);
    MlaWeights& A = P.mla;
    for (auto [name, t] : {std::pair<const char*, Tensor*>{"mla.q_proj", &A.q_proj}, {"mla.q_a", &A.q_a},
                           {"mla.q_a_norm", &A.q_a_norm}, {"mla.q_b", &A.q_b}, {"mla.kv_a", &A.kv_a},
                           {"mla.kv_a_norm", &A.kv_a_norm}, {"mla.kv_b", &A.kv_b}, {"mla.o", &A.o}})
      add(pre + name, *t);
  };
  if (unit == L + 1) {
    add("final_norm.weight", final_norm_w);
    add("final_norm.bias", final_norm_b);
    if (!c.tie_word_embeddings || !embed.defined()) add("lm_head", lm_head);
    for (int64_t l = L; l < static_cast<int64_t>(layers.size()); ++l) layer(l);
    add("mtp.enorm", mtp.enorm);
    add("mtp.hnorm", mtp.hnorm);
    add("mtp.eh_proj", mtp.eh_proj);
    add("mtp.head_norm", mtp.head_norm);
  } else if (unit > 0) {
    layer(unit - 1);
  }
  return out;
}

void Params::tie(const ModelConfig& c) {
  if (c.tie_word_embeddings && embed.defined()) lm_head = embed;  // (a last stage keeps its copy)
}

std::vector<Tensor*> Params::matmul_weights() {
  std::vector<Tensor*> w;
  for (auto& L : layers)
    for (Linear* lin : {&L.qkv, &L.o, &L.up, &L.down})
      if (lin->weight.defined()) w.push_back(&lin->weight);
  if (lm_head.defined()) w.push_back(&lm_head);
  return w;
}

void Params::zero() {
  auto z = [](Tensor& t) {
    if (t.defined()) t.zero();
  };
  z(embed);
  z(pos_embed);
  for (auto& L : layers) {
    for (Tensor* t : {&L.norm1_w, &L.norm1_b, &L.norm2_w, &L.norm2_b, &L.q_norm, &L.k_norm, &L.post_attn_norm,
                      &L.post_mlp_norm, &L.moe.router, &L.moe.gate_up, &L.moe.down,
                      &L.moe.shared_gate, &L.moe.bias, &L.mla.q_proj, &L.mla.q_a, &L.mla.q_a_norm, &L.mla.q_b,
                      &L.mla.kv_a, &L.mla.kv_a_norm, &L.mla.kv_b, &L.mla.o})
      z(*t);
    for (Linear* lin : {&L.qkv, &L.o, &L.up, &L.down}) {
      z(lin->weight);
      z(lin->bias);
    }
  }
  for (Tensor* t : {&mtp.enorm, &mtp.hnorm, &mtp.eh_proj, &mtp.head_norm}) z(*t);
  z(final_norm_w);
  z(final_norm_b);
  z(lm_head);  // tied: zeroes embed again, harmless
}

}  // namespace tessera::model
