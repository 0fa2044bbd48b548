// Windowed perplexity evaluation.
#include "tessera/model/perplexity.h"

#include <cmath>
#include <fstream>

#include "tessera/base/timer.h"
#include "tessera/kernels/cross_entropy.h"

namespace tessera::model {

PerplexityResult evaluate_perplexity(const Model& model, const std::vector<int32_t>& ids,
                                     int64_t ctx, bool show_progress) {
  const auto& c = model.config();
  TESSERA_CHECK(ctx >= 2, "perplexity: context length must be at least 2, got ", ctx);
  TESSERA_CHECK(c.uses_rope() || ctx <= c.max_position_embeddings, "perplexity: context ", ctx,
                " exceeds max_position_embeddings ", c.max_position_embeddings);
  TESSERA_CHECK(ids.size() >= 2, "perplexity: need at least 2 tokens, got ", ids.size());
  for (size_t i = 0; i < ids.size(); ++i)
    TESSERA_CHECK(ids[i] >= 0 && ids[i] < c.vocab_size, "perplexity: token ", i, " has id ",
                  ids[i], " outside the vocabulary [0, ", c.vocab_size, ")");
  PerplexityResult r;
  double nll = 0.0;
  const int64_t n = static_cast<int64_t>(ids.size());
  const int64_t nwin = (n + ctx - 1) / ctx;
  base::ProgressBar bar("perplexity", nwin);
  KVCache cache = KVCache::create(c, ctx);
  for (int64_t start = 0; start < n; start += ctx) {
    const int64_t len = std::min(ctx, n - start);
    if (len < 2) break;
    std::vector<int32_t> window(ids.begin() + start, ids.begin() + start + len);
    cache.reset();
    Tensor logits = model.forward(window, cache, true);  // (len, V)
    Tensor targets = Tensor::empty({len - 1}, DType::kI32);
    for (int64_t i = 0; i + 1 < len; ++i) targets.data<int32_t>()[i] = window[i + 1];
    const auto ce = kernels::cross_entropy(logits.slice(0, 0, len - 1), targets, nullptr, nullptr, 1.f);
    nll += ce.loss_sum;
    r.tokens += ce.count;
    ++r.windows;
    if (show_progress) bar.update(r.windows);
  }
  r.mean_nll = nll / static_cast<double>(r.tokens);
  r.perplexity = std::exp(r.mean_nll);
  return r;
}

std::vector<int32_t> read_token_ids(const std::string& path) {
  std::ifstream f(path);
  TESSERA_CHECK(f.good(), "cannot open token id file '", path, "'");
  std::vector<int32_t> ids;
  std::string tok;
  while (f >> tok) {
    size_t pos = 0;
    long long v = 0;
    try {
      v = std::stoll(tok, &pos);
    } catch (...) {
      pos = 0;
    }
    TESSERA_CHECK(pos == tok.size() && v >= 0 && v <= INT32_MAX, path, ": token ", ids.size(),
                  " '", tok, "' is not a non-negative integer id");
    ids.push_back(static_cast<int32_t>(v));
  }
  return ids;
}

}  // namespace tessera::model
