// Scaled RoPE (rope_scaling.h): the frequencies of transformers' modeling_rope_utils.py,
// computed in f32 as it computes them (the f32 roundings of inv_freq are part of the
// model's numerics at long positions), and DeepSeek's YaRN for latent attention.
#include "tessera/model/rope_scaling.h"

#include <algorithm>
#include <cmath>

#include <nlohmann/json.hpp>

#include "tessera/base/error.h"
#include "tessera/io/json_file.h"
#include "tessera/model/config.h"

namespace tessera::model {

std::optional<RopeScaling> parse_rope_scaling(const nlohmann::json& j, const std::string& source) {
  TESSERA_CHECK(j.is_object(), source, ": 'rope_scaling' must be an object, got ", io::json_brief(j));
  const auto type = j.contains("type") ? j.at("type") : j.value("rope_type", nlohmann::json());
  const std::string t = type.is_string() ? type.get<std::string>() : "";
  if (t == "default") return std::nullopt;
  TESSERA_CHECK(t == "linear" || t == "dynamic" || t == "yarn" || t == "llama3", source, ": 'rope_scaling' type ",
                io::json_brief(type), " is not supported (linear, dynamic, yarn, llama3)");
  RopeScaling r;
  r.type = t;
  auto num = [&](const char* key, double dflt, double lo, double hi) {
    const auto it = j.find(key);
    if (it == j.end() || it->is_null()) return dflt;
    TESSERA_CHECK(it->is_number() && std::isfinite(it->get<double>()) && it->get<double>() >= lo &&
                      it->get<double>() <= hi,
                  source, ": 'rope_scaling' ", key, " must be a number in [", lo, ", ", hi, "], got ",
                  io::json_brief(*it));
    return it->get<double>();
  };
  auto needs = [&](const char* key) {
    TESSERA_CHECK(j.contains(key) && !j.at(key).is_null(), source, ": 'rope_scaling' ", t, " needs '", key, "'");
  };
  if (j.contains("original_max_position_embeddings"))
    r.original_max_position_embeddings = static_cast<int64_t>(num("original_max_position_embeddings", 0, 1, 1 << 24));
  if (t == "yarn" && !j.contains("factor")) {
    needs("original_max_position_embeddings");  // factor: max_position_embeddings / original
    r.factor = 0;
  } else {
    needs("factor");
    r.factor = num("factor", 1.0, 1.0, 1e6);
  }
  if (t == "llama3") {
    needs("low_freq_factor");
    needs("high_freq_factor");
    needs("original_max_position_embeddings");
    r.low_freq_factor = num("low_freq_factor", 1.0, 1e-6, 1e6);
    r.high_freq_factor = num("high_freq_factor", 4.0, 1e-6, 1e6);
    TESSERA_CHECK(r.high_freq_factor > r.low_freq_factor, source, ": 'rope_scaling' high_freq_factor ",
                  r.high_freq_factor, " must be above low_freq_factor ", r.low_freq_factor);
  }
  if (t == "yarn") {
    r.beta_fast = num("beta_fast", 32.0, 1e-6, 1e6);
    r.beta_slow = num("beta_slow", 1.0, 1e-6, 1e6);
    r.has_mscale = j.contains("mscale") || j.contains("mscale_all_dim");
    r.mscale = num("mscale", 1.0, 0.0, 1e6);
    r.mscale_all_dim = num("mscale_all_dim", 0.0, 0.0, 1e6);
    r.attention_factor = num("attention_factor", 0.0, 0.0, 1e6);
    if (auto tr = j.find("truncate"); tr != j.end() && !tr->is_null()) {
      TESSERA_CHECK(tr->is_boolean(), source, ": 'rope_scaling' truncate must be true or false, got ",
                    io::json_brief(*tr));
      r.truncate = tr->get<bool>();
    }
  }
  return r;
}

nlohmann::json rope_scaling_json(const RopeScaling& r) {
  nlohmann::json j = {{"rope_type", r.type}};
  if (r.factor > 0) j["factor"] = r.factor;
  if (r.original_max_position_embeddings > 0) j["original_max_position_embeddings"] = r.original_max_position_embeddings;
  if (r.type == "llama3") {
    j["low_freq_factor"] = r.low_freq_factor;
    j["high_freq_factor"] = r.high_freq_factor;
  }
  if (r.type == "yarn") {
    j["beta_fast"] = r.beta_fast;
    j["beta_slow"] = r.beta_slow;
    if (r.has_mscale) j["mscale"] = r.mscale, j["mscale_all_dim"] = r.mscale_all_dim;
    if (r.attention_factor > 0) j["attention_factor"] = r.attention_factor;
    if (!r.truncate) j["truncate"] = false;
  }
  return j;
}

int64_t rotary_dim(const ModelConfig& c) {
  if (c.uses_mla()) return c.qk_rope_head_dim;
  return static_cast<int64_t>(static_cast<double>(c.head_dim) * c.partial_rotary_factor);  // Python's int()
}

int64_t max_context(const ModelConfig& c) {
  const int64_t mp = c.max_position_embeddings;
  if (!c.rope_scaling || !c.uses_rope()) return mp;
  const RopeScaling& r = *c.rope_scaling;
  if (r.type == "llama3") return mp;  // the config's length is already the extended one
  const int64_t original = r.type == "yarn" && r.original_max_position_embeddings > 0
                               ? r.original_max_position_embeddings : mp;
  const double factor = r.factor > 0 ? r.factor : static_cast<double>(mp) / static_cast<double>(original);
  return std::clamp<int64_t>(static_cast<int64_t>(static_cast<double>(original) * factor), mp, limits::kMaxPositions);
}

namespace {

// get_mscale(scale, mscale) as transformers' yarn computes it.
double mscale_of(double scale, double m) { return scale <= 1 ? 1.0 : 0.1 * m * std::log(scale) + 1.0; }

// transformers' _compute_yarn_parameters (with the factor given by the config, as its
// fix of issue 38224 keeps it).
kernels::RopeFreqs yarn_freqs(const RopeScaling& r, int64_t dim, float theta, int64_t max_pos) {
  const int64_t original = r.original_max_position_embeddings > 0 ? r.original_max_position_embeddings : max_pos;
  const double factor = r.factor > 0 ? r.factor : static_cast<double>(max_pos) / static_cast<double>(original);
  kernels::RopeFreqs f;
  if (r.attention_factor > 0)
    f.attention_factor = static_cast<float>(r.attention_factor);
  else if (r.mscale != 0 && r.mscale_all_dim != 0)
    f.attention_factor = static_cast<float>(mscale_of(factor, r.mscale) / mscale_of(factor, r.mscale_all_dim));
  else
    f.attention_factor = static_cast<float>(mscale_of(factor, 1.0));
  auto correction_dim = [&](double rotations) {
    return (static_cast<double>(dim) * std::log(static_cast<double>(original) / (rotations * 2 * M_PI))) /
           (2 * std::log(static_cast<double>(theta)));
  };
  double low = correction_dim(r.beta_fast), high = correction_dim(r.beta_slow);
  if (r.truncate) low = std::floor(low), high = std::ceil(high);
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(dim - 1));
  if (low == high) high += 0.001;
  const float lo = static_cast<float>(low), span = static_cast<float>(high - low), fac = static_cast<float>(factor);
  f.inv_freq.resize(dim / 2);
  for (int64_t i = 0; i < dim / 2; ++i) {
    const float pos_freq = std::pow(theta, static_cast<float>(2 * i) / static_cast<float>(dim));
    const float extra = 1.0f / pos_freq, inter = 1.0f / (fac * pos_freq);
    const float keep = 1.0f - std::clamp((static_cast<float>(i) - lo) / span, 0.0f, 1.0f);
    f.inv_freq[i] = inter * (1.0f - keep) + extra * keep;
  }
  return f;
}

// transformers' _compute_llama3_parameters, in f32.
void llama3_scale(const RopeScaling& r, std::vector<float>& inv_freq) {
  const float factor = static_cast<float>(r.factor), lo = static_cast<float>(r.low_freq_factor),
              hi = static_cast<float>(r.high_freq_factor);
  const double old_ctx = static_cast<double>(r.original_max_position_embeddings);
  const float low_wavelen = static_cast<float>(old_ctx / r.low_freq_factor);
  const float high_wavelen = static_cast<float>(old_ctx / r.high_freq_factor);
  for (float& f : inv_freq) {
    const float wavelen = static_cast<float>(2 * M_PI) / f;
    const float scaled = wavelen > low_wavelen ? f / factor : f;
    if (!(wavelen < high_wavelen) && !(wavelen > low_wavelen)) {
      const float smooth = (static_cast<float>(old_ctx) / wavelen - lo) / (hi - lo);
      f = (1.0f - smooth) * scaled / factor + smooth * scaled;
    } else {
      f = scaled;
    }
  }
}

}  // namespace

kernels::RopeFreqs rope_freqs(const ModelConfig& c, int64_t seq_len) {
  const int64_t dim = rotary_dim(c);
  if (!c.rope_scaling) return kernels::rope_default_freqs(dim, c.rope_theta);
  const RopeScaling& r = *c.rope_scaling;
  if (r.type == "yarn") return yarn_freqs(r, dim, c.rope_theta, c.max_position_embeddings);
  if (r.type == "dynamic") {
    // base x ((factor x seq_len / max_pos) - (factor - 1)) ^ (dim / (dim - 2)), in double
    // as Python computes it, then used as an f32 base; unchanged up to max_pos.
    const double mp = static_cast<double>(c.max_position_embeddings);
    const double len = std::max(static_cast<double>(seq_len), mp);
    const double d = static_cast<double>(dim);
    const double base = c.rope_theta * std::pow(r.factor * len / mp - (r.factor - 1), d / (d - 2));
    return kernels::rope_default_freqs(dim, static_cast<float>(base));
  }
  kernels::RopeFreqs f = kernels::rope_default_freqs(dim, c.rope_theta);
  if (r.type == "linear")
    for (float& v : f.inv_freq) v /= static_cast<float>(r.factor);
  else if (r.type == "llama3")
    llama3_scale(r, f.inv_freq);
  return f;
}

double yarn_mscale(double scale, double mscale) { return mscale_of(scale, mscale); }

std::vector<double> yarn_inv_freq(const RopeScaling& r, int64_t dim, double theta, int64_t original) {
  const double max_pos = static_cast<double>(r.original_max_position_embeddings > 0
                                                 ? r.original_max_position_embeddings : original);
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
