// LoRA adapters as after training, for tests: A as LoraWeights::init draws it, B normal with
// standard deviation `b_std` (B = 0, the fresh state, would give A no gradient and change
// no output).
#pragma once
#include <cstdint>
#include <random>

#include "tessera/model/lora.h"

namespace tessera::testing {

inline model::LoraWeights trained_lora(const model::ModelConfig& c, const model::LoraConfig& config, uint32_t seed,
                                       float b_std) {
  model::LoraWeights w = model::LoraWeights::init(c, config, seed);
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.f, b_std);
  for (auto& layer : w.layers)
    for (auto& p : layer)
      if (p.b.defined())
        for (int64_t i = 0; i < p.b.numel(); ++i) p.b.data<float>()[i] = n(rng);
  return w;
}

}  // namespace tessera::testing
