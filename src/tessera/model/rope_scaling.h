// Scaled rotary embeddings read from config.json's rope_scaling (transformers'
// modeling_rope_utils.py): linear, dynamic (NTK), yarn and llama3 for the standard
// attention, and DeepSeek's YaRN (modeling_deepseek.py's DeepseekV2YarnRotaryEmbedding,
// with its softmax scale) for latent attention. Internal to model/.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "tessera/kernels/rope.h"

namespace tessera::model {

struct ModelConfig;

struct RopeScaling {
  std::string type;  // linear | dynamic | yarn | llama3
  double factor = 1.0;
  int64_t original_max_position_embeddings = 0;  // 0: not given (yarn: max_position_embeddings)
  double low_freq_factor = 1.0, high_freq_factor = 4.0;  // llama3
  double beta_fast = 32.0, beta_slow = 1.0;            // yarn
  double mscale = 1.0, mscale_all_dim = 0.0;           // yarn (DeepSeek's naming)
  double attention_factor = 0.0;                       // yarn; 0: derived from factor and mscale
  bool truncate = true;                                // yarn: integer correction range
  bool has_mscale = false;                             // mscale / mscale_all_dim were given
};

// config.json's rope_scaling object ("type" or "rope_type"); nullopt for type "default".
// A one-line error naming `source` and the field for a type or value not supported.
std::optional<RopeScaling> parse_rope_scaling(const nlohmann::json& j, const std::string& source);
nlohmann::json rope_scaling_json(const RopeScaling& r);

// The features rotated per head: head_dim x partial_rotary_factor (qk_rope_head_dim for
// latent attention).
int64_t rotary_dim(const ModelConfig& c);
// The longest context the model's positions are meant for: max_position_embeddings, or
// factor x the original context for linear / dynamic / yarn scaling (vLLM's derived length).
int64_t max_context(const ModelConfig& c);
// The frequencies and cos/sin factor of the standard attention's RoPE for a sequence whose
// last position is seq_len - 1 (dynamic NTK rescales past max_position_embeddings, as
// transformers' dynamic_rope_update does for each forward; the other types ignore it).
kernels::RopeFreqs rope_freqs(const ModelConfig& c, int64_t seq_len);

// YaRN: yarn_get_mscale(scale, mscale) = 0.1 mscale ln(scale) + 1 (1 for scale <= 1).
double yarn_mscale(double scale, double mscale);
// The dim/2 frequencies: theta^(-2i/dim) at high frequencies, divided by `factor` at low
// ones, a linear ramp between the correction range of beta_fast and beta_slow rotations
// over the original context (`original`: the context when the scaling names none).
std::vector<double> yarn_inv_freq(const RopeScaling& r, int64_t dim, double theta, int64_t original = 0);
// DeepSeek's factor on cos and sin: yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim).
double yarn_attention_factor(const RopeScaling& r);
// DeepSeek multiplies the softmax scale by yarn_mscale(factor, mscale_all_dim)^2 (when
// mscale_all_dim is set).
double yarn_softmax_factor(const RopeScaling& r);

}  // namespace tessera::model
