// Dynamic loss scaling for fp16 training with torch.cuda.amp.GradScaler's semantics:
// the loss is multiplied by scale(), grads are unscaled before clipping and the
// optimizer step, a step with an inf/NaN grad is skipped and the scale backed off, and
// the scale grows after growth_interval consecutive good steps.
#pragma once
#include <cstdint>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "tessera/train/optimizer.h"

namespace tessera::train {

class LossScaler {
 public:
  explicit LossScaler(double init_scale = 65536.0, double growth_factor = 2.0,
                      double backoff_factor = 0.5, int64_t growth_interval = 2000,
                      bool enabled = true);

  bool enabled() const { return enabled_; }
  // The factor to multiply the loss by; 1 when disabled. Held in f32 as torch holds it.
  double scale() const { return enabled_ ? scale_ : 1.0; }

  // Multiplies every grad in place by 1/scale (computed in f64, rounded to f32, like
  // GradScaler.unscale_) and returns true when every grad was finite before unscaling.
  // Call once per optimizer step, after all micro-batches, before clipping. Disabled:
  // returns true and leaves the grads alone.
  bool unscale_and_check(const std::vector<ParamRef>& params);

  // GradScaler.update() with the found_inf of this step (the caller skipped the
  // optimizer step when it was true): found_inf -> scale *= backoff_factor, tracker = 0;
  // else ++tracker and when it reaches growth_interval, scale *= growth_factor (kept
  // only when finite) and tracker = 0.
  void update(bool found_inf);

  int64_t growth_tracker() const { return growth_tracker_; }
  int64_t skipped_steps() const { return skipped_steps_; }  // updates with found_inf
  int64_t growth_count() const { return growth_count_; }    // times the scale grew
  int64_t backoff_count() const { return backoff_count_; }  // times the scale was cut

  // {"enabled", "scale", "growth_factor", "backoff_factor", "growth_interval",
  //  "growth_tracker", "skipped_steps", "growth_count", "backoff_count"}
  nlohmann::json to_json() const;
  // Restores what to_json wrote; errors name the key at fault. Unknown keys are errors.
  void load_json(const nlohmann::json& j);

 private:
  float scale_;  // torch keeps the scale in an f32 tensor
  double growth_factor_, backoff_factor_;
  int64_t growth_interval_;
  bool enabled_;
  int64_t growth_tracker_ = 0;
  int64_t skipped_steps_ = 0, growth_count_ = 0, backoff_count_ = 0;
};

}  // namespace tessera::train
