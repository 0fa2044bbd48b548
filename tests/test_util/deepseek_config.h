// A tiny DeepSeek-V3-shaped configuration for tests that need one (engine, serving):
// latent attention (q_lora 24, kv_lora 32, rope 8, nope 16, v 16) over the "tiny" shape,
// a dense first layer, then 4 routed experts (top 2, sigmoid noaux_tc in 2 groups) with a
// shared one.
#pragma once
#include "tessera/model/config.h"

namespace tessera::testing {

inline model::ModelConfig tiny_deepseek_v3(int64_t vocab, int64_t layers, int64_t topk_group) {
  model::ModelConfig c = model::ModelConfig::named_shape("tiny");
  c.model_type = "deepseek_v3";
  c.vocab_size = vocab;
  c.num_layers = layers;
  c.q_lora_rank = 24, c.kv_lora_rank = 32, c.qk_nope_head_dim = 16, c.qk_rope_head_dim = 8, c.v_head_dim = 16;
  c.num_kv_heads = c.num_heads;
  c.head_dim = 24;
  c.num_experts = 4;
  c.experts_per_token = 2;
  c.moe_intermediate_size = 32;
  c.n_shared_experts = 1;
  c.first_k_dense_replace = 1;
  c.moe_sigmoid = true;
  c.topk_method = "noaux_tc";
  c.router_bias = true;
  c.n_group = 2, c.topk_group = topk_group;
  c.routed_scaling_factor = 2.5;
  return c;
}

}  // namespace tessera::testing
