// Single-sequence generation through the engine: prefill the prompt into the paged KV
// cache, then decode until max_tokens or an end-of-sequence token.
#pragma once
#include <functional>
#include <vector>

#include "tessera/infer/engine.h"
#include "tessera/infer/sampler.h"
#include "tessera/model/model.h"

namespace tessera::infer {

struct GenerateOptions {
  int64_t max_tokens = 32;
  SamplingParams sampling;
  bool stop_at_eos = true;
  // Engine settings (speculative decoding, batch invariance, block size); the KV pool and
  // context length are sized for this one request unless set.
  EngineConfig engine;
  const model::Model* draft = nullptr;  // for engine.speculative_method "draft"
  // Tensor parallelism: `model` is rank 0's shard and this its group (tp_serving.h).
  TpGroup* tp = nullptr;
  // The model's tokenizer: needed by structured outputs (sampling.guided); may be null.
  const io::Tokenizer* tokenizer = nullptr;
};

struct GenerateResult {
  std::vector<int32_t> tokens;  // generated ids (prompt excluded)
  double prefill_seconds = 0.0;
  double decode_seconds = 0.0;
  std::string finish_reason;    // "stop" or "length"
  int64_t spec_proposed = 0, spec_accepted = 0;  // speculative decoding
};

// on_token (optional) is called with each new id as soon as it is sampled.
GenerateResult generate(const model::Model& model, const std::vector<int32_t>& prompt,
                        const GenerateOptions& options,
                        const std::function<void(int32_t)>& on_token = {});

}  // namespace tessera::infer
