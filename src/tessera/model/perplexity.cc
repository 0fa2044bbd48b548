// Windowed perplexity evaluation.
#include "tessera/model/perplexity.h"

#include <algorithm>
#include <cmath>
#include <fstream>

#include "tessera/base/logging.h"
#include "tessera/base/timer.h"
#include "tessera/kernels/cross_entropy.h"

namespace tessera::model {

namespace {

void check_stream(const Model& model, const std::vector<int32_t>& ids, int64_t ctx, bool warn = true) {
  const auto& c = model.config();
  TESSERA_CHECK(ctx >= 2, "perplexity: context length must be at least 2, got ", ctx);
  TESSERA_CHECK(c.uses_rope() || ctx <= c.max_position_embeddings, "perplexity: context ", ctx,
                " exceeds max_position_embeddings ", c.max_position_embeddings);
  // Rotary positions run past the trained context, as llama.cpp's perplexity allows, but
  // the model has never seen them: say so.
  if (warn && ctx > c.max_position_embeddings)
    TESSERA_LOG(kWarn, "perplexity: context ", ctx, " is beyond the ", c.max_position_embeddings,
                " positions the model was trained on; expect a higher perplexity");
  TESSERA_CHECK(ids.size() >= 2, "perplexity: need at least 2 tokens, got ", ids.size());
  for (size_t i = 0; i < ids.size(); ++i)
    TESSERA_CHECK(ids[i] >= 0 && ids[i] < c.vocab_size, "perplexity: token ", i, " has id ",
                  ids[i], " outside the vocabulary [0, ", c.vocab_size, ")");
}

// Calls f(window, logits (len, V)) for each window of the stream, from position 0.
template <typename F>
int64_t for_each_window(const std::vector<const Model*>& models, const std::vector<int32_t>& ids,
                        int64_t ctx, bool show_progress, F f) {
  const int64_t n = static_cast<int64_t>(ids.size());
  base::ProgressBar bar("perplexity", (n + ctx - 1) / ctx);
  std::vector<KVCache> caches;
  for (const Model* m : models) caches.push_back(KVCache::create(m->config(), ctx));
  int64_t windows = 0;
  for (int64_t start = 0; start < n; start += ctx) {
    const int64_t len = std::min(ctx, n - start);
    if (len < 2) break;
    const std::vector<int32_t> window(ids.begin() + start, ids.begin() + start + len);
    std::vector<Tensor> logits;
    for (size_t i = 0; i < models.size(); ++i) {
      caches[i].reset();
      logits.push_back(models[i]->forward(window, caches[i], true).to(DType::kF32).contiguous());
    }
    f(window, logits);
    ++windows;
    if (show_progress) bar.update(windows);
  }
  return windows;
}

// log softmax of one row of logits, in double.
void log_softmax_row(const float* z, int64_t V, std::vector<double>& out) {
  const double lse = kernels::log_sum_exp(z, V);
  out.resize(V);
  for (int64_t v = 0; v < V; ++v) out[v] = z[v] - lse;
}

// Mean and standard error (sample standard deviation / sqrt n) of sums s1 = sum x, s2 = sum x^2.
void mean_se(double s1, double s2, int64_t n, double& mean, double& se) {
  mean = s1 / n;
  se = n > 1 ? std::sqrt(std::max(0.0, (s2 - s1 * mean) / (n - 1)) / n) : 0.0;
}

}  // namespace

PerplexityResult evaluate_perplexity(const Model& model, const std::vector<int32_t>& ids,
                                     int64_t ctx, bool show_progress) {
  check_stream(model, ids, ctx);
  PerplexityResult r;
  double nll = 0.0;
  const auto score = [&](const std::vector<int32_t>& window, const std::vector<Tensor>& logits) {
    const auto len = static_cast<int64_t>(window.size());
    Tensor targets = Tensor::empty({len - 1}, DType::kI32);
    for (int64_t i = 0; i + 1 < len; ++i) targets.data<int32_t>()[i] = window[i + 1];
    const auto ce = kernels::cross_entropy(logits[0].slice(0, 0, len - 1), targets, nullptr, nullptr, 1.f);
    nll += ce.loss_sum;
    r.tokens += ce.count;
  };
  r.windows = for_each_window({&model}, ids, ctx, show_progress, score);
  r.mean_nll = nll / static_cast<double>(r.tokens);
  r.perplexity = std::exp(r.mean_nll);
  return r;
}

KlDivergenceResult evaluate_kl_divergence(const Model& model, const Model& reference,
                                          const std::vector<int32_t>& ids, int64_t ctx,
                                          bool show_progress) {
  check_stream(model, ids, ctx);
  check_stream(reference, ids, ctx, /*warn=*/false);
  const int64_t V = model.config().vocab_size;
  TESSERA_CHECK(reference.config().vocab_size == V, "kl divergence: the model's vocabulary (", V,
                ") and the reference's (", reference.config().vocab_size, ") differ");
  KlDivergenceResult r;
  double nll_m = 0, nll_r = 0, lr1 = 0, lr2 = 0, k1 = 0, k2 = 0, top = 0, dp2 = 0;
  std::vector<double> klds, lm, lref;
  const int64_t windows = for_each_window(
      {&model, &reference}, ids, ctx, show_progress,
      [&](const std::vector<int32_t>& window, const std::vector<Tensor>& logits) {
        for (size_t i = 0; i + 1 < window.size(); ++i) {
          log_softmax_row(logits[0].data<float>() + i * V, V, lm);
          log_softmax_row(logits[1].data<float>() + i * V, V, lref);
          double kld = 0;
          int64_t am = 0, ar = 0;
          for (int64_t v = 0; v < V; ++v) {
            kld += std::exp(lref[v]) * (lref[v] - lm[v]);
            if (lm[v] > lm[am]) am = v;
            if (lref[v] > lref[ar]) ar = v;
          }
          kld = std::max(kld, 0.0);  // rounding below zero where the two agree
          const int32_t t = window[i + 1];
          const double d = lref[t] - lm[t];  // nll(model) - nll(reference)
          nll_m -= lm[t], nll_r -= lref[t];
          lr1 += d, lr2 += d * d;
          k1 += kld, k2 += kld * kld;
          top += am == ar;
          const double dp = std::exp(lm[t]) - std::exp(lref[t]);
          dp2 += dp * dp;
          klds.push_back(kld);
        }
      });
  const auto n = static_cast<int64_t>(klds.size());
  for (PerplexityResult* p : {&r.model, &r.reference}) p->tokens = n, p->windows = windows;
  r.model.mean_nll = nll_m / n, r.reference.mean_nll = nll_r / n;
  r.model.perplexity = std::exp(r.model.mean_nll), r.reference.perplexity = std::exp(r.reference.mean_nll);
  mean_se(lr1, lr2, n, r.log_ratio, r.log_ratio_se);
  mean_se(k1, k2, n, r.kld, r.kld_se);
  mean_se(top, top, n, r.same_top, r.same_top_se);  // 0 / 1 values: sum x^2 = sum x
  r.rms_delta_p = std::sqrt(dp2 / n);
  std::sort(klds.begin(), klds.end());
  r.kld_median = klds[n / 2];
  r.kld_p99 = klds[std::min<int64_t>(n - 1, static_cast<int64_t>(0.99 * n))];
  r.kld_max = klds.back();
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
