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

// A model against a reference (the float model a quantized one came from) on the same
// windows, as llama.cpp's `llama-perplexity --kl-divergence` reports it. Every figure is a
// mean over predicted tokens; the standard errors (se) are the sample standard deviation
// over sqrt(tokens), so two models' figures can be told apart from the noise of the text:
// - log_ratio: nll(model) - nll(reference), whose mean is ln(PPL(model) / PPL(reference));
//   paired token by token, so far less noisy than the two perplexities' difference;
// - kld: KL(reference || model) of the next-token distributions (never negative);
// - same_top: whether the two argmax tokens agree (1 or 0);
// - delta_p: p_model(target) - p_reference(target), summarised by its root mean square.
struct KlDivergenceResult {
  PerplexityResult model, reference;
  double log_ratio = 0, log_ratio_se = 0;
  double kld = 0, kld_se = 0, kld_median = 0, kld_p99 = 0, kld_max = 0;
  double same_top = 0, same_top_se = 0;
  double rms_delta_p = 0;
};
KlDivergenceResult evaluate_kl_divergence(const Model& model, const Model& reference,
                                          const std::vector<int32_t>& ids, int64_t ctx,
                                          bool show_progress = false);

// Reads whitespace-separated token ids; errors name the file and the bad token.
std::vector<int32_t> read_token_ids(const std::string& path);

}  // namespace tessera::model
