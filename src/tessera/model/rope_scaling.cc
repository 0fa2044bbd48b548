// YaRN rope scaling (rope_scaling.h), as DeepSeek's modeling_deepseek.py computes it.
#include "tessera/model/rope_scaling.h"

#include <algorithm>
#include <cmath>

#include <nlohmann/json.hpp>

#include "tessera/base/error.h"
#include "tessera/io/json_file.h"

namespace tessera::model {

RopeScaling parse_rope_scaling(const nlohmann::json& j, const std::string& source) {
  TESSERA_CHECK(j.is_object(), source, ": 'rope_scaling' must be an object, got ", io::json_brief(j));
  RopeScaling r;
  const auto type = j.contains("type") ? j.at("type") : j.value("rope_type", nlohmann::json());
  TESSERA_CHECK(type.is_string() && type.get<std::string>() == "yarn", source, ": 'rope_scaling' type ",
                io::json_brief(type), " is not supported yet (yarn)");
  r.type = "yarn";
  auto num = [&](const char* key, double dflt, double lo, double hi) {
    const auto it = j.find(key);
    if (it == j.end() || it->is_null()) return dflt;
    TESSERA_CHECK(it->is_number() && std::isfinite(it->get<double>()) && it->get<double>() >= lo &&
                      it->get<double>() <= hi,
                  source, ": 'rope_scaling' ", key, " must be a number in [", lo, ", ", hi, "], got ",
                  io::json_brief(*it));
    return it->get<double>();
  };
  TESSERA_CHECK(j.contains("factor"), source, ": 'rope_scaling' yarn needs 'factor'");
  r.factor = num("factor", 1.0, 1.0, 1e6);
  TESSERA_CHECK(j.contains("original_max_position_embeddings"), source,
                ": 'rope_scaling' yarn needs 'original_max_position_embeddings'");
  r.original_max_position_embeddings = static_cast<int64_t>(num("original_max_position_embeddings", 0, 1, 1 << 24));
  r.beta_fast = num("beta_fast", 32.0, 1e-6, 1e6);
  r.beta_slow = num("beta_slow", 1.0, 1e-6, 1e6);
  r.mscale = num("mscale", 1.0, 0.0, 1e6);
  r.mscale_all_dim = num("mscale_all_dim", 0.0, 0.0, 1e6);
  return r;
}

nlohmann::json rope_scaling_json(const RopeScaling& r) {
  return {{"type", r.type}, {"factor", r.factor},
          {"original_max_position_embeddings", r.original_max_position_embeddings},
          {"beta_fast", r.beta_fast}, {"beta_slow", r.beta_slow}, {"mscale", r.mscale},
          {"mscale_all_dim", r.mscale_all_dim}};
}

double yarn_mscale(double scale, double mscale) { return scale <= 1 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0; }

std::vector<double> yarn_inv_freq(const RopeScaling& r, int64_t dim, double theta) {
  const double max_pos = static_cast<double>(r.original_max_position_embeddings);
  auto correction_dim = [&](double rotations) {
    return (static_cast<double>(dim) * std::log(max_pos / (rotations * 2 * M_PI))) / (2 * std::log(theta));
  };
  const double low = std::max(std::floor(correction_dim(r.beta_fast)), 0.0);
  double high = std::min(std::ceil(correction_dim(r.beta_slow)), static_cast<double>(dim - 1));
  if (low == high) high += 0.001;
  std::vector<double> f(dim / 2);
  for (int64_t i = 0; i < dim / 2; ++i) {
    // transformers computes these in f32; the f32 values, then widened.
    const double extra = static_cast<float>(1.0 / std::pow(theta, 2.0 * i / dim));
    const double inter = static_cast<float>(1.0 / (r.factor * std::pow(theta, 2.0 * i / dim)));
    const double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
    const double keep = 1.0 - ramp;  // inv_freq_mask: 1 keeps the unscaled frequency
    f[i] = static_cast<float>(inter * (1.0 - keep) + extra * keep);
  }
  return f;
}

double yarn_attention_factor(const RopeScaling& r) {
  return yarn_mscale(r.factor, r.mscale) / yarn_mscale(r.factor, r.mscale_all_dim);
}

double yarn_softmax_factor(const RopeScaling& r) {
  if (r.mscale_all_dim == 0) return 1.0;
  const double m = yarn_mscale(r.factor, r.mscale_all_dim);
  return m * m;
}

}  // namespace tessera::model
