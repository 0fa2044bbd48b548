// Learning-rate schedules as a multiplier of the peak lr: linear warmup, then cosine
// decay, warmup-stable-decay (WSD), or constant.
#pragma once
#include <cstdint>
#include <string>

namespace tessera::train {

// Field names are the TOML keys of the trainer's [schedule] table.
struct ScheduleConfig {
  std::string kind = "cosine";  // "cosine" | "wsd" | "constant"
  int64_t warmup_steps = 0;
  int64_t total_steps = 1;
  double min_lr_ratio = 0.1;    // the multiplier reached at the last step (cosine, wsd)
  double decay_fraction = 0.2;  // wsd: share of total_steps spent decaying
  std::string wsd_decay = "linear";  // wsd: "linear" or "sqrt" (1 - sqrt)
};

// Throws tessera::Error naming the field when a value is out of range.
void validate_schedule(const ScheduleConfig& s);

// Multiplier for 0-based optimizer step `step`. With n = step + 1 (steps done after it):
//   warmup (n <= warmup_steps):  n / warmup_steps
//   cosine:   min + (1 - min) * (1 + cos(pi * q)) / 2,  q = (n - warmup) / (total - warmup)
//   wsd:      1 until the last D = round(decay_fraction * total) steps (at most
//             total - warmup), then with q = (n - (total - D)) / D:
//             linear: 1 - (1 - min) * q;   sqrt: min + (1 - min) * (1 - sqrt(q))
//   constant: 1
// so the last step (step = total - 1) runs at exactly min_lr_ratio; steps past the end
// stay there. Validates s.
double lr_multiplier(const ScheduleConfig& s, int64_t step);

}  // namespace tessera::train
