// Next-token log-likelihood over a long token stream through the serving engine's own
// pieces (scheduler, block manager, paged KV cache, step runner), the way StreamingLLM's
// Fig. 3 evaluates: every token is scored from what the cache holds when it arrives. With
// attention sinks the cache keeps the first S tokens and the recent window (positions
// within the cache); without a window it keeps everything (dense attention, positions
// growing past the model's training context). `tessera bench stream-ppl` drives it.
#pragma once
#include <cstdint>
#include <vector>

#include "tessera/kernels/paged_attention.h"
#include "tessera/model/model.h"

namespace tessera::infer {

struct StreamEvalOptions {
  int64_t attention_sinks = 0;  // S (with window > 0)
  int64_t window = 0;           // W; 0: dense, nothing evicted
  int64_t block_size = 16;
  // Tokens per step. With a window the scores do not depend on it (the scheduler's rule
  // shifts at the same tokens); larger chunks batch the matmuls.
  int64_t chunk = 16;
  kernels::KvCacheDtype kv_cache_dtype = kernels::KvCacheDtype::kF32;
};

struct StreamEvalResult {
  std::vector<double> nll;     // nll[i] = -log p(tokens[i + 1] | stream up to i): size - 1 values
  int64_t max_blocks = 0;      // KV blocks held at most (after any step)
  int64_t shifts = 0;          // window shifts applied
  double seconds = 0;          // wall time of the whole stream
};

// Throws (one line) for fewer than two tokens, a bad option, or a model attention sinks
// do not support (model::attention_sinks_unsupported).
StreamEvalResult evaluate_stream(const model::Model& m, const std::vector<int32_t>& tokens,
                                 const StreamEvalOptions& o);

}  // namespace tessera::infer
