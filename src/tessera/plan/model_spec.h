// The shape of a model as the planner sees it: layer sizes, attention kind (GQA / MLA),
// MoE experts, and parameter counts derived from them. Read from a built-in preset, a
// Hugging Face config.json, or derived from a parameter count (`--params 200b`).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace tessera::plan {

struct ModelSpec {
  std::string name;
  int64_t layers = 0;
  int64_t hidden = 0;
  int64_t heads = 0;
  int64_t kv_heads = 0;
  int64_t head_dim = 0;  // GQA head size (q, k and v)
  int64_t ffn = 0;       // dense MLP intermediate size
  int64_t vocab = 0;
  bool tied = false;          // lm_head shares the input embedding
  bool gated_mlp = true;      // SwiGLU (3 matrices) vs GELU MLP (2)
  bool layernorm = false;     // LayerNorm (weight + bias) vs RMSNorm (weight)
  bool linear_biases = false; // GPT-2/3: a bias on every linear
  bool qkv_bias = false;      // Qwen2: biases on q, k, v only
  int64_t learned_positions = 0;  // rows of a learned position table (GPT), 0 for RoPE
  // Mixture of experts (0 experts = dense).
  int64_t experts = 0;         // routed experts per MoE layer
  int64_t top_k = 0;           // experts each token is routed to
  int64_t moe_ffn = 0;         // intermediate size of one routed expert
  int64_t shared_experts = 0;  // always-active experts per MoE layer (DeepSeek, Qwen-MoE)
  int64_t shared_ffn = 0;      // intermediate size of one shared expert
  int64_t dense_layers = 0;    // the first layers use the dense MLP (DeepSeek first_k_dense_replace)
  int64_t moe_every = 1;       // after those, every n-th layer is MoE
  // Multi-head latent attention (DeepSeek-V2/V3); q_lora_rank 0 = plain q projection.
  bool mla = false;
  int64_t q_lora_rank = 0, kv_lora_rank = 0, rope_head_dim = 0, nope_head_dim = 0, v_head_dim = 0;

  bool is_moe() const { return experts > 0; }
  bool layer_is_moe(int64_t l) const;
  int64_t moe_layer_count() const;

  // Attention geometry for compute: query heads x qk dim, value dim.
  int64_t qk_dim() const { return mla ? nope_head_dim + rope_head_dim : head_dim; }
  int64_t v_dim() const { return mla ? v_head_dim : head_dim; }
  int64_t q_width() const { return heads * qk_dim(); }
  int64_t k_width() const { return (mla ? heads : kv_heads) * qk_dim(); }
  int64_t v_width() const { return (mla ? heads : kv_heads) * v_dim(); }
  int64_t o_width() const { return heads * v_dim(); }  // input of the output projection

  // Parameters (elements).
  int64_t attention_params() const;    // one layer's attention, biases included
  int64_t dense_mlp_params() const;    // one dense MLP
  int64_t expert_params() const;       // one routed expert
  int64_t shared_expert_params() const;  // all shared experts of one MoE layer
  int64_t router_params() const;       // one MoE layer's router
  int64_t norm_params() const;         // one layer's norms (and MLA's latent norms)
  int64_t layer_params(int64_t l) const;         // all of layer l
  int64_t layer_routed_params(int64_t l) const;  // routed experts of layer l (0 if dense)
  int64_t embedding_params() const;    // token (+ learned position) embeddings
  int64_t lm_head_params() const;      // 0 when tied
  int64_t final_norm_params() const;
  int64_t total_params() const;
  int64_t routed_expert_params() const;  // all routed experts of all layers
  // Parameters one token's forward pass touches (top-k of the routed experts).
  int64_t active_params() const;
  // Matmul weight elements one token multiplies by (lm_head included, the embedding
  // lookup not): forward matmul FLOPs per token = 2 x this.
  int64_t active_matmul_params() const;
  // KV cache elements per token per layer: 2 * kv_heads * head_dim (GQA), or the latent
  // kv_lora_rank + rope_head_dim (MLA, cached compressed as DeepSeek-V2 section 2.1 does).
  int64_t kv_elements_per_token_layer() const;

  void validate(const std::string& source) const;
  std::string describe() const;  // one line: params, layers, hidden, heads, experts
};

std::vector<std::string> model_preset_names();
// A built-in shape: llama2-7b, llama2-13b, llama2-70b, llama3-8b, llama3-70b,
// llama3-405b, gpt3-175b, mixtral-8x7b, deepseek-v3. Throws naming the unknown name.
ModelSpec model_preset(const std::string& name);
// From a Hugging Face config.json object (llama, mistral, qwen2, mixtral, qwen2_moe,
// deepseek_v2/v3, gpt2 and similar); errors name `source` and the key.
ModelSpec model_from_hf_json(const nlohmann::json& j, const std::string& source);
// A preset name, a config.json path, or a directory holding config.json.
ModelSpec load_model(const std::string& name_or_path);

// A dense Llama-style model of about `params` parameters. Unset sizes (0) are derived:
// layers from the aspect ratio hidden ~ 128 x layers (GPT-3 and Llama 3 405B sit near
// it), then hidden (a multiple of 128) to match the count; heads of 128 dims, 8 KV
// heads, ffn = 8/3 hidden rounded up to 256 (Llama's rule).
struct ParametricOptions {
  double params = 0;
  int64_t layers = 0, hidden = 0, heads = 0, kv_heads = 0, ffn = 0;
  int64_t vocab = 128256;  // Llama 3's tokenizer
};
ModelSpec parametric_model(const ParametricOptions& o);

// "200b", "7e9", "1.5T", "4M", "70m" -> a count (k = 1e3, m = 1e6, b = 1e9, t = 1e12).
// Throws naming `what` and the text.
double parse_count(const std::string& text, const std::string& what);

}  // namespace tessera::plan
