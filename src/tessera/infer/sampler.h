// Token sampling from logits: greedy, temperature, top-k and top-p (nucleus),
// deterministic for a given seed.
#pragma once
#include <cstdint>
#include <random>

#include "tessera/tensor/tensor.h"

namespace tessera::infer {

struct SamplingParams {
  float temperature = 0.f;  // 0 = greedy
  int64_t top_k = 0;        // 0 = off
  float top_p = 1.f;        // 1 = off
  uint64_t seed = 0;
  void validate() const;    // throws naming the bad value
};

class Sampler {
 public:
  explicit Sampler(const SamplingParams& p);
  // logits: (V) or (1, V) f32. Returns the chosen token id.
  int32_t sample(const Tensor& logits);

 private:
  SamplingParams params_;
  std::mt19937_64 rng_;
};

}  // namespace tessera::infer
