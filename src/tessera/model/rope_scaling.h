// Scaled rotary embeddings read from config.json's rope_scaling. Today: YaRN as DeepSeek
// writes it (modeling_deepseek.py's DeepseekV2YarnRotaryEmbedding), used by latent
// attention. Internal to model/.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace tessera::model {

struct RopeScaling {
  std::string type;  // "yarn"
  double factor = 1.0;
  int64_t original_max_position_embeddings = 0;
  double beta_fast = 32.0, beta_slow = 1.0;
  double mscale = 1.0, mscale_all_dim = 0.0;
};

// config.json's rope_scaling object; a one-line error naming `source` and the field for a
// type or value not supported.
RopeScaling parse_rope_scaling(const nlohmann::json& j, const std::string& source);
nlohmann::json rope_scaling_json(const RopeScaling& r);

// YaRN: yarn_get_mscale(scale, mscale) = 0.1 mscale ln(scale) + 1 (1 for scale <= 1).
double yarn_mscale(double scale, double mscale);
// The dim/2 frequencies: theta^(-2i/dim) at high frequencies, divided by `factor` at low
// ones, a linear ramp between the correction range of beta_fast and beta_slow rotations
// over the original context.
std::vector<double> yarn_inv_freq(const RopeScaling& r, int64_t dim, double theta);
// The factor on cos and sin: yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim).
double yarn_attention_factor(const RopeScaling& r);
// DeepSeek multiplies the softmax scale by yarn_mscale(factor, mscale_all_dim)^2 (when
// mscale_all_dim is set).
double yarn_softmax_factor(const RopeScaling& r);

}  // namespace tessera::model
