// GradScaler-style dynamic loss scaling (see loss_scaler.h). The two CUDA kernels
// GradScaler relies on (_amp_foreach_non_finite_check_and_unscale_ and
// _amp_update_scale_) are reproduced here on the CPU.
#include "tessera/train/loss_scaler.h"

#include <atomic>
#include <cmath>
#include <nlohmann/json.hpp>
#include <set>

#include "tessera/base/thread_pool.h"
#include "tessera/kernels/optimizer_math.h"

namespace tessera::train {
namespace {

}  // namespace

LossScaler::LossScaler(double init_scale, double growth_factor, double backoff_factor,
                       int64_t growth_interval, bool enabled)
    : scale_(static_cast<float>(init_scale)),
      growth_factor_(growth_factor),
      backoff_factor_(backoff_factor),
      growth_interval_(growth_interval),
      enabled_(enabled) {
  TESSERA_CHECK(std::isfinite(init_scale) && init_scale > 0, "loss scaler: init_scale ",
                init_scale, " must be a finite number > 0");
  TESSERA_CHECK(growth_factor > 1.0 && std::isfinite(growth_factor), "loss scaler: growth_factor ",
                growth_factor, " must be > 1");
  TESSERA_CHECK(backoff_factor > 0.0 && backoff_factor < 1.0, "loss scaler: backoff_factor ",
                backoff_factor, " must be in (0, 1)");
  TESSERA_CHECK(growth_interval >= 1, "loss scaler: growth_interval ", growth_interval,
                " must be >= 1");
}

bool LossScaler::unscale_and_check(const std::vector<ParamRef>& params) {
  if (!enabled_) return true;
  // GradScaler: inv_scale = self._scale.double().reciprocal().float()
  const float inv = static_cast<float>(1.0 / static_cast<double>(scale_));
  std::atomic<bool> finite{true};
  for (const ParamRef& p : params) {
    TESSERA_CHECK(p.grad.defined() && p.grad.dtype() == DType::kF32 && p.grad.is_contiguous() &&
                      p.grad.device() == Device::kCPU,
                  "loss scaler: grad of '", p.name, "' must be a contiguous f32 CPU tensor");
    float* g = p.grad.data<float>();
    base::parallel_for(p.grad.numel(), int64_t{1} << 16, [&](int64_t i0, int64_t i1) {
      if (!kernels::unscale_check_finite(g + i0, i1 - i0, inv)) finite.store(false, std::memory_order_relaxed);
    });
  }
  return finite.load();
}

void LossScaler::update(bool found_inf) {
  if (!enabled_) return;
  // ATen's _amp_update_scale_ (the scale is an f32 tensor, the factors doubles).
  if (found_inf) {
    scale_ = static_cast<float>(static_cast<double>(scale_) * backoff_factor_);
    growth_tracker_ = 0;
    ++skipped_steps_;
    ++backoff_count_;
    return;
  }
  const int64_t successful = growth_tracker_ + 1;
  if (successful == growth_interval_) {
    const float grown = static_cast<float>(static_cast<double>(scale_) * growth_factor_);
    if (std::isfinite(grown)) {
      scale_ = grown;
      ++growth_count_;
    }
    growth_tracker_ = 0;
  } else {
    growth_tracker_ = successful;
  }
}

nlohmann::json LossScaler::to_json() const {
  return {{"enabled", enabled_},
          {"scale", static_cast<double>(scale_)},
          {"growth_factor", growth_factor_},
          {"backoff_factor", backoff_factor_},
          {"growth_interval", growth_interval_},
          {"growth_tracker", growth_tracker_},
          {"skipped_steps", skipped_steps_},
          {"growth_count", growth_count_},
          {"backoff_count", backoff_count_}};
}

void LossScaler::load_json(const nlohmann::json& j) {
  TESSERA_CHECK(j.is_object(), "loss scaler state: expected a JSON object, got ", j.type_name());
  static const std::set<std::string> kKeys = {
      "enabled",        "scale",          "growth_factor", "backoff_factor", "growth_interval",
      "growth_tracker", "skipped_steps",  "growth_count",  "backoff_count"};
  for (const auto& [key, value] : j.items())
    TESSERA_CHECK(kKeys.count(key), "loss scaler state: unknown key '", key, "'");
  for (const auto& key : kKeys)
    TESSERA_CHECK(j.contains(key), "loss scaler state: missing key '", key, "'");
  auto number = [&](const char* key) {
    TESSERA_CHECK(j.at(key).is_number(), "loss scaler state: '", key, "' must be a number, got ",
                  j.at(key).dump());
    return j.at(key).get<double>();
  };
  auto count = [&](const char* key) {
    TESSERA_CHECK(j.at(key).is_number_integer() && j.at(key).get<int64_t>() >= 0,
                  "loss scaler state: '", key, "' must be an integer >= 0, got ", j.at(key).dump());
    return j.at(key).get<int64_t>();
  };
  TESSERA_CHECK(j.at("enabled").is_boolean(), "loss scaler state: 'enabled' must be true or false");
  // Validate through the constructor, then take everything at once.
  LossScaler s(number("scale"), number("growth_factor"), number("backoff_factor"),
               count("growth_interval"), j.at("enabled").get<bool>());
  s.growth_tracker_ = count("growth_tracker");
  TESSERA_CHECK(s.growth_tracker_ < s.growth_interval_, "loss scaler state: 'growth_tracker' ",
                s.growth_tracker_, " must be below growth_interval ", s.growth_interval_);
  s.skipped_steps_ = count("skipped_steps");
  s.growth_count_ = count("growth_count");
  s.backoff_count_ = count("backoff_count");
  *this = s;
}

}  // namespace tessera::train
