// Perplexity of a model over a token stream (Tessera's `eval perplexity`).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "tessera/model/model.h"

namespace tessera::model {

struct PerplexityResult {
  double mean_nll = 0.0;   // natural-log negative log-likelihood per predicted token
  double perplexity = 0.0; // exp(mean_nll)
  int64_t tokens = 0;      // predicted tokens
  int64_t windows = 0;
};

// The stream is cut into consecutive, non-overlapping windows of `ctx` tokens (the last
// may be shorter; a 1-token window predicts nothing and is dropped). Each window runs
// from position 0 and predicts tokens 1..len-1; the mean is over all predicted tokens.
PerplexityResult evaluate_perplexity(const Model& model, const std::vector<int32_t>& ids,
                                     int64_t ctx, bool show_progress = false);

// Reads whitespace-separated token ids; errors name the file and the bad token.
std::vector<int32_t> read_token_ids(const std::string& path);

}  // namespace tessera::model
