// Requests that read their prompt positions instead of only running them: prompt
// log-probabilities (vLLM's prompt_logprobs; OpenAI's echo with logprobs) and pooled
// embeddings (the mean of the final hidden states, vLLM's pooling type MEAN). The engine
// reads them from the prefill steps' logits and hidden states (engine_prompt.cc).
#pragma once
#include <cstdint>
#include <vector>

#include "tessera/infer/block_manager.h"
#include "tessera/infer/sampler.h"

namespace tessera::infer {

// One prompt token's log-probability given the tokens before it.
struct PromptLogprob {
  int32_t token = 0;     // the prompt token
  float logprob = 0.f;   // raw: log_softmax of the logits of the position before it
  int64_t rank = 0;      // 1 = the most likely token (ties: lower id first)
  std::vector<TokenLogprob> top;  // the prompt_logprobs most likely tokens, highest first
};

// `logits`: (vocab) the logits of position i - 1; `token`: prompt token i; `top`: how many
// alternatives to list.
PromptLogprob prompt_logprob(const float* logits, int64_t vocab, int32_t token, int top);

// The engine's state for one such request (keyed by its id = sample 0's sequence).
struct PromptWork {
  std::vector<int32_t> prompt;
  int top = -1;          // prompt_logprobs alternatives; -1: no prompt log-probabilities
  bool pooling = false;  // an embedding request
  int64_t n = 1;         // samples of the request
  int64_t done = 0;      // positions [0, done) read; a recomputation (preemption) skips them
  std::vector<PromptLogprob> logprobs;  // entry i: prompt token i + 1
  std::vector<double> sum;              // pooling: (H) sum of positions [0, done)
  std::vector<uint8_t> sent;            // per sample: its first output carried the logprobs
};

// This step's positions of one request to read (filled while the step is planned).
struct PromptRead {
  RequestId id = 0;
  int64_t first = 0, count = 0;  // prompt positions [first, first + count)
  int64_t hidden_row = 0;        // the step's row of position `first`
  int64_t logit_row = -1;        // its row in the step's logits (-1: hidden states only)
};

}  // namespace tessera::infer
