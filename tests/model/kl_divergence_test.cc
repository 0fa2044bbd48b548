// `eval perplexity --kl-reference`: a model against the float model it came from, on the
// same windows. The figures are checked against their definitions computed here from the
// two models' logits in double (log-softmax, KL(p_ref || p), argmax, p(target)), and a
// model against itself gives KL 0, the same perplexity and full top-token agreement.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "tessera/model/model.h"
#include "tessera/model/perplexity.h"
#include "tessera/model/quantize.h"

namespace tessera {
namespace {

std::vector<int32_t> stream(int64_t n, int64_t vocab) {
  std::vector<int32_t> ids(n);
  for (int64_t i = 0; i < n; ++i) ids[i] = static_cast<int32_t>((i * 37 + i * i * 11 + 5) % vocab);
  return ids;
}

std::vector<double> log_softmax(const float* z, int64_t V) {
  const double mx = *std::max_element(z, z + V);
  double sum = 0;
  for (int64_t v = 0; v < V; ++v) sum += std::exp(z[v] - mx);
  std::vector<double> out(V);
  for (int64_t v = 0; v < V; ++v) out[v] = z[v] - mx - std::log(sum);
  return out;
}

TEST(KlDivergence, FiguresMatchTheirDefinitionsOnTheSameWindows) {
  const auto c = model::ModelConfig::named_shape("tiny");
  const model::Model ref = model::Model::random(c, DType::kF32, 11);
  model::Model q = model::Model::random(c, DType::kF32, 11);
  auto o = model::quantize_options_for_scheme("int4");
  o.group_size = 32;
  model::quantize_model(q, o);
  const int64_t ctx = 24, V = c.vocab_size;
  const auto ids = stream(3 * ctx + 7, V);  // three whole windows and a short one

  const auto r = model::evaluate_kl_divergence(q, ref, ids, ctx);

  std::vector<double> kld, d, dp;
  double nll_q = 0, nll_r = 0;
  int64_t same = 0;
  for (size_t start = 0; start < ids.size(); start += ctx) {
    const std::vector<int32_t> w(ids.begin() + start, ids.begin() + std::min(ids.size(), start + ctx));
    auto cq = model::KVCache::create(c, ctx), cr = model::KVCache::create(c, ctx);
    const Tensor lq = q.forward(w, cq, true), lr = ref.forward(w, cr, true);
    for (size_t i = 0; i + 1 < w.size(); ++i) {
      const auto a = log_softmax(lq.data<float>() + i * V, V), b = log_softmax(lr.data<float>() + i * V, V);
      double k = 0;
      for (int64_t v = 0; v < V; ++v) k += std::exp(b[v]) * (b[v] - a[v]);
      kld.push_back(k);
      const int32_t t = w[i + 1];
      nll_q -= a[t], nll_r -= b[t];
      d.push_back(b[t] - a[t]);
      dp.push_back(std::exp(a[t]) - std::exp(b[t]));
      same += std::max_element(a.begin(), a.end()) - a.begin() == std::max_element(b.begin(), b.end()) - b.begin();
    }
  }
  const auto n = static_cast<double>(kld.size());
  ASSERT_EQ(r.model.tokens, static_cast<int64_t>(n));
  EXPECT_EQ(r.model.windows, 4);
  EXPECT_NEAR(r.model.mean_nll, nll_q / n, 1e-9);
  EXPECT_NEAR(r.reference.mean_nll, nll_r / n, 1e-9);
  const auto mean = [&](const std::vector<double>& x) { return std::accumulate(x.begin(), x.end(), 0.0) / n; };
  const auto se = [&](const std::vector<double>& x) {
    const double m = mean(x);
    double s = 0;
    for (double v : x) s += (v - m) * (v - m);
    return std::sqrt(s / (n - 1) / n);
  };
  EXPECT_NEAR(r.log_ratio, mean(d), 1e-9);
  EXPECT_NEAR(r.log_ratio_se, se(d), 1e-9);
  EXPECT_NEAR(r.log_ratio, r.model.mean_nll - r.reference.mean_nll, 1e-9);
  EXPECT_NEAR(r.kld, mean(kld), 1e-9);
  EXPECT_NEAR(r.kld_se, se(kld), 1e-9);
  EXPECT_GT(r.kld, 0.0) << "int4 changed nothing";
  std::sort(kld.begin(), kld.end());
  EXPECT_NEAR(r.kld_max, kld.back(), 1e-12);
  EXPECT_NEAR(r.kld_median, kld[kld.size() / 2], 1e-12);
  EXPECT_NEAR(r.same_top, same / n, 1e-12);
  double dp2 = 0;
  for (double v : dp) dp2 += v * v;
  EXPECT_NEAR(r.rms_delta_p, std::sqrt(dp2 / n), 1e-12);
  // The plain perplexity of the same model over the same windows agrees.
  EXPECT_NEAR(model::evaluate_perplexity(q, ids, ctx).mean_nll, r.model.mean_nll, 1e-5);
}

TEST(KlDivergence, AModelAgainstItselfDivergesByNothing) {
  const auto c = model::ModelConfig::named_shape("tiny");
  const model::Model m = model::Model::random(c, DType::kF32, 5);
  const auto r = model::evaluate_kl_divergence(m, m, stream(50, c.vocab_size), 16);
  EXPECT_LT(r.kld, 1e-12);
  EXPECT_EQ(r.log_ratio, 0.0);
  EXPECT_EQ(r.same_top, 1.0);
  EXPECT_EQ(r.rms_delta_p, 0.0);
  EXPECT_EQ(r.model.perplexity, r.reference.perplexity);
}

TEST(KlDivergence, ModelsOfDifferentVocabulariesAreAOneLineError) {
  auto c = model::ModelConfig::named_shape("tiny");
  const model::Model a = model::Model::random(c, DType::kF32, 1);
  c.vocab_size += 8;
  const model::Model b = model::Model::random(c, DType::kF32, 1);
  try {
    model::evaluate_kl_divergence(a, b, stream(20, 100), 8);
    FAIL() << "different vocabularies were compared";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("vocabulary"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace tessera
