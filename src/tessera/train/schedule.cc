// Learning-rate schedules (see schedule.h for the formulas).
#include "tessera/train/schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "tessera/base/error.h"

namespace tessera::train {

void validate_schedule(const ScheduleConfig& s) {
  TESSERA_CHECK(s.kind == "cosine" || s.kind == "wsd" || s.kind == "constant",
                "schedule: kind = '", s.kind, "' is not one of cosine, wsd, constant");
  TESSERA_CHECK(s.total_steps >= 1, "schedule: total_steps = ", s.total_steps, " must be >= 1");
  TESSERA_CHECK(s.warmup_steps >= 0 && s.warmup_steps <= s.total_steps,
                "schedule: warmup_steps = ", s.warmup_steps, " must be in [0, total_steps = ",
                s.total_steps, "]");
  TESSERA_CHECK(std::isfinite(s.min_lr_ratio) && s.min_lr_ratio >= 0 && s.min_lr_ratio <= 1,
                "schedule: min_lr_ratio = ", s.min_lr_ratio, " must be in [0, 1]");
  TESSERA_CHECK(std::isfinite(s.decay_fraction) && s.decay_fraction >= 0 && s.decay_fraction <= 1,
                "schedule: decay_fraction = ", s.decay_fraction, " must be in [0, 1]");
  TESSERA_CHECK(s.wsd_decay == "linear" || s.wsd_decay == "sqrt", "schedule: wsd_decay = '",
                s.wsd_decay, "' is not one of linear, sqrt");
}

double lr_multiplier(const ScheduleConfig& s, int64_t step) {
  validate_schedule(s);
  TESSERA_CHECK(step >= 0, "schedule: step ", step, " is negative");
  const int64_t n = step + 1;  // steps taken once this one is done
  if (n <= s.warmup_steps) return static_cast<double>(n) / static_cast<double>(s.warmup_steps);
  if (s.kind == "constant") return 1.0;
  const double lo = s.min_lr_ratio;
  if (s.kind == "cosine") {
    // n > warmup here, so total > warmup.
    const double q = std::min(1.0, double(n - s.warmup_steps) / double(s.total_steps - s.warmup_steps));
    return lo + (1.0 - lo) * 0.5 * (1.0 + std::cos(std::numbers::pi * q));
  }
  const int64_t decay_steps = std::min<int64_t>(
      s.total_steps - s.warmup_steps, std::llround(s.decay_fraction * double(s.total_steps)));
  const int64_t decay_start = s.total_steps - decay_steps;
  if (n <= decay_start || decay_steps == 0) return 1.0;
  const double q = std::min(1.0, double(n - decay_start) / double(decay_steps));
  if (s.wsd_decay == "linear") return 1.0 - (1.0 - lo) * q;
  return lo + (1.0 - lo) * (1.0 - std::sqrt(q));
}

}  // namespace tessera::train
