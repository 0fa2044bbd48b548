// Single-sequence generation: prefill the prompt into a KV cache, then decode one
// token at a time until max_tokens or an end-of-sequence token.
#pragma once
#include <functional>
#include <vector>

#include "tessera/infer/sampler.h"
#include "tessera/model/model.h"

namespace tessera::infer {

struct GenerateOptions {
  int64_t max_tokens = 32;
  SamplingParams sampling;
  bool stop_at_eos = true;
};

struct GenerateResult {
  std::vector<int32_t> tokens;  // generated ids (prompt excluded)
  double prefill_seconds = 0.0;
  double decode_seconds = 0.0;
  std::string finish_reason;    // "stop" or "length"
};

// on_token (optional) is called with each new id as soon as it is sampled.
GenerateResult generate(const model::Model& model, const std::vector<int32_t>& prompt,
                        const GenerateOptions& options,
                        const std::function<void(int32_t)>& on_token = {});

}  // namespace tessera::infer
