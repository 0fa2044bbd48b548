// Model configuration read from a Hugging Face config.json (llama, qwen2, gpt2),
// normalised into one struct the model code uses.
#pragma once
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>

#include <nlohmann/json_fwd.hpp>

#include "tessera/base/checked.h"
#include "tessera/io/quant_config.h"
#include "tessera/model/rope_scaling.h"

namespace tessera::model {

enum class Arch { kLlama, kQwen2, kGpt2 };

// Upper bounds on config.json sizes, far above every released model (Llama 3.1 405B: hidden
// 16384, 126 layers, 128 heads; Gemma 3: vocab 262144; DeepSeek-V3: 256 experts), that keep
// every size computed from them inside int64. Shared with the planner's config reader.
namespace limits {
constexpr int64_t kMaxVocab = int64_t{1} << 24;
constexpr int64_t kMaxHidden = int64_t{1} << 17;
constexpr int64_t kMaxIntermediate = int64_t{1} << 20;
constexpr int64_t kMaxLayers = 1024;
constexpr int64_t kMaxHeads = 4096;
constexpr int64_t kMaxHeadDim = 1024;
constexpr int64_t kMaxPositions = int64_t{1} << 24;
constexpr int64_t kMaxExperts = 4096;
}  // namespace limits

struct ModelConfig {
  Arch arch = Arch::kLlama;
  std::string model_type = "llama";  // as written in config.json
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t max_position_embeddings = 0;
  float norm_eps = 1e-5f;
  float rope_theta = 10000.f;
  bool tie_word_embeddings = false;
  bool qkv_bias = false;  // qwen2 (and llama with attention_bias)
  bool qk_norm = false;   // qwen3: RMSNorm over each head's q and k (q_norm / k_norm) before RoPE
  int64_t bos_token_id = -1;
  int64_t eos_token_id = -1;
  // Mixture of experts (model_type mixtral, qwen2_moe): every layer's MLP is num_experts
  // SwiGLU experts of moe_intermediate_size features, experts_per_token of them per token
  // (model/moe.h). 0 experts: a dense MLP. qwen2_moe adds a shared expert, run for every
  // token and scaled by sigmoid(h . shared_expert_gate): it is the layer's dense MLP (up,
  // down), of intermediate_size = shared_expert_intermediate_size features.
  int64_t num_experts = 0;
  int64_t experts_per_token = 0;
  int64_t moe_intermediate_size = 0;
  bool shared_expert = false;
  int64_t dense_intermediate_size = 0;  // qwen2_moe's own intermediate_size (no dense layer runs it)
  bool norm_topk_prob = true;          // renormalise the chosen experts' probabilities
  // Each MoE layer has a per-expert selection bias, gate.e_score_correction_bias
  // (auxiliary-loss-free balancing: config.json "topk_method": "noaux_tc", as DeepSeek-V3
  // writes it; training moves it with [training] moe_bias_update_rate).
  bool router_bias = false;
  double router_aux_loss_coef = 0.0;   // the load-balancing loss's weight in training
  bool output_router_logits = false;   // transformers adds that loss only when this is set
  // DeepSeek-V2/V3 (model_type deepseek_v2, deepseek_v3): multi-head latent attention
  // (model/mla.h) in place of q/k/v/o when kv_lora_rank > 0 (num_kv_heads = num_heads and
  // head_dim = qk_nope + qk_rope, as the query heads are); layers before
  // first_k_dense_replace (and those off the moe_layer_freq stride) keep a dense MLP of
  // intermediate_size, the others are MoE with n_shared_experts always-on experts (one
  // SwiGLU MLP of n_shared_experts x moe_intermediate_size features, ungated: the layer's
  // dense MLP tensors); the router as DeepSeek's MoEGate (moe_scoring, groups, scaling).
  int64_t q_lora_rank = 0, kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0, qk_rope_head_dim = 0, v_head_dim = 0;
  int64_t first_k_dense_replace = 0, moe_layer_freq = 1;
  int64_t n_shared_experts = 0;
  bool moe_sigmoid = false;             // scoring_func "sigmoid" (DeepSeek-V3), else softmax
  std::string topk_method = "greedy";   // greedy | group_limited_greedy | noaux_tc
  int64_t n_group = 1, topk_group = 1;
  double routed_scaling_factor = 1.0;
  // DeepSeek-V2's balancing loss (its modeling code's MoEGate in training): alpha times, per
  // MoE layer, sum_e f_e P_e over each sequence (seq_aux) or the whole batch, f_e the share
  // of the top-k slots routed to e times E, P_e e's mean score. Trained for deepseek_v2
  // (trains_seq_aux); DeepSeek-V3's code has none (it balances with the selection bias).
  double aux_loss_alpha = 0.0;
  bool seq_aux = true;
  bool trains_seq_aux() const { return model_type == "deepseek_v2" && num_experts > 0 && aux_loss_alpha > 0; }
  // Multi-token prediction modules (DeepSeek-V3 num_nextn_predict_layers; 0 or 1): stored
  // as layer num_layers (model.layers.{L}.*), run by training (its loss weighted by
  // [training] mtp_loss_weight) and by --speculative mtp.
  int64_t mtp_layers = 0;
  // config.json's rope_scaling (rope_scaling.h: linear, dynamic, yarn, llama3; latent
  // attention: DeepSeek's yarn); unset: plain RoPE. partial_rotary_factor: the share of each
  // head's features that rotate (rotary_dim(config) = int(head_dim x factor)).
  std::optional<RopeScaling> rope_scaling;
  double partial_rotary_factor = 1.0;
  // Sliding-window attention (mistral / mixtral sliding_window; qwen2 / qwen2_moe
  // use_sliding_window, from layer max_window_layers on, as transformers' layer_types):
  // a windowed layer's query at position p sees keys (p - sliding_window, p].
  int64_t sliding_window = 0;                // 0: no layer is windowed
  int64_t max_window_layers = 0;             // the layers before it attend to everything
  bool window_alternate = false;             // gemma2: only the even layers are windowed
  int64_t layer_window(int64_t layer) const {  // 0: full attention
    return sliding_window > 0 && layer >= max_window_layers && layer < num_layers &&
                   (!window_alternate || layer % 2 == 0)
               ? sliding_window : 0;
  }
  bool all_layers_windowed() const { return sliding_window > 0 && max_window_layers == 0 && !window_alternate; }
  // Gemma 2 (model_type gemma2): a GeGLU MLP (gelu_tanh gate), RMSNorm weights stored as
  // offsets from 1 (held here as 1 + w, converted on load and save), a norm after attention
  // and after the MLP as well as before each, the embedding scaled by sqrt(hidden), scores
  // scaled by query_pre_attn_scalar^-1/2 and soft-capped, the logits soft-capped.
  bool gelu_mlp = false;
  bool norm_offset = false;
  bool sandwich_norms = false;
  bool embed_scale = false;
  double query_pre_attn_scalar = 0;          // 0: head_dim
  float attn_softcap = 0.f, final_softcap = 0.f;
  float attention_scale() const {
    return 1.f / std::sqrt(static_cast<float>(query_pre_attn_scalar > 0 ? query_pre_attn_scalar
                                                                          : static_cast<double>(head_dim)));
  }
  // config.json's quantization_config: the block linears are stored quantized (AutoGPTQ /
  // AutoAWQ tensors) and run quantized. Unset for a float checkpoint.
  std::optional<io::QuantCheckpointFormat> quantization;

  bool uses_layernorm() const { return arch == Arch::kGpt2; }  // else RMSNorm
  bool uses_rope() const { return arch != Arch::kGpt2; }
  bool gated_mlp() const { return arch != Arch::kGpt2; }       // SwiGLU vs GELU MLP
  bool linear_biases() const { return arch == Arch::kGpt2; }   // biases on every linear
  bool is_moe() const { return num_experts > 0; }
  bool uses_mla() const { return kv_lora_rank > 0; }
  bool is_deepseek() const { return model_type == "deepseek_v2" || model_type == "deepseek_v3"; }
  // Layer `layer`'s MLP: mixture of experts (else dense).
  bool layer_is_moe(int64_t layer) const {
    return is_moe() && layer >= first_k_dense_replace && layer % moe_layer_freq == 0;
  }
  // The features of layer `layer`'s dense MLP (a MoE layer's shared expert; 0: none).
  int64_t mlp_size(int64_t layer) const;
  int64_t q_dim() const { return checked_mul(num_heads, head_dim, "num_heads * head_dim"); }
  int64_t kv_dim() const { return checked_mul(num_kv_heads, head_dim, "num_kv_heads * head_dim"); }
  int64_t qkv_dim() const { return checked_add(q_dim(), checked_mul(2, kv_dim(), "kv_dim"), "qkv_dim"); }
  int64_t num_parameters() const;
  // Bytes of matmul weights read per decoded token (embedding row lookups excluded).
  int64_t matmul_weight_elements() const;

  // Throws with a message naming `source` and the key at fault.
  static ModelConfig from_json(const nlohmann::json& j, const std::string& source);
  static ModelConfig load(const std::string& model_dir);  // DIR/config.json, or a GGUF file's metadata
  // For a path io::is_gguf_path has turned down: a one-line error when it is a plain file
  // (a model is a directory or a .gguf file).
  static void check_model_path(const std::string& path);
  nlohmann::json to_json() const;                           // Hugging Face layout
  // Named Llama shapes for benchmarks: "small", "1b"; "tiny" for tests.
  static ModelConfig named_shape(const std::string& name);
  void validate(const std::string& source) const;
};

const char* arch_name(Arch a);

}  // namespace tessera::model
