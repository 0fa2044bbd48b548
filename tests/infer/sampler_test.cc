// Sampler: greedy, temperature, top-k, top-p, determinism, bad parameters.
#include <gtest/gtest.h>

#include <cmath>
#include <map>

#include "tessera/infer/sampler.h"

namespace tessera::infer {
namespace {

Tensor logits_of(const std::vector<float>& probs) {
  std::vector<float> l;
  for (float p : probs) l.push_back(std::log(p));
  return Tensor::from_vector(l, {static_cast<int64_t>(l.size())});
}

std::vector<double> frequencies(Sampler& s, const Tensor& logits, int n) {
  std::vector<double> f(logits.numel(), 0.0);
  for (int i = 0; i < n; ++i) f[s.sample(logits)] += 1.0 / n;
  return f;
}

TEST(Sampler, GreedyPicksArgmax) {
  Sampler s({});
  EXPECT_EQ(s.sample(logits_of({0.1f, 0.2f, 0.6f, 0.1f})), 2);
  Tensor two_d = logits_of({0.5f, 0.1f, 0.4f}).view({1, 3});
  EXPECT_EQ(s.sample(two_d), 0);
}

TEST(Sampler, TemperatureOneFollowsTheDistribution) {
  Sampler s({1.f, 0, 1.f, 123});
  const auto f = frequencies(s, logits_of({0.1f, 0.2f, 0.7f}), 40000);
  EXPECT_NEAR(f[0], 0.1, 0.01);
  EXPECT_NEAR(f[1], 0.2, 0.01);
  EXPECT_NEAR(f[2], 0.7, 0.01);
}

TEST(Sampler, LowTemperatureSharpens) {
  Sampler s({0.5f, 0, 1.f, 5});
  // p^2 normalised: 0.01, 0.04, 0.49 -> 0.0185, 0.074, 0.907
  const auto f = frequencies(s, logits_of({0.1f, 0.2f, 0.7f}), 40000);
  EXPECT_NEAR(f[2], 0.49 / 0.54, 0.01);
}

TEST(Sampler, TopKRestrictsAndRenormalises) {
  Sampler s({1.f, 2, 1.f, 9});
  const auto f = frequencies(s, logits_of({0.3f, 0.1f, 0.4f, 0.2f}), 40000);
  EXPECT_EQ(f[1], 0.0);
  EXPECT_EQ(f[3], 0.0);
  EXPECT_NEAR(f[2], 0.4 / 0.7, 0.01);
}

TEST(Sampler, TopPKeepsSmallestPrefixReachingMass) {
  // Sorted: 0.5, 0.3, 0.15, 0.05; top_p 0.75 keeps {0.5, 0.3}.
  Sampler s({1.f, 0, 0.75f, 3});
  const auto f = frequencies(s, logits_of({0.15f, 0.5f, 0.05f, 0.3f}), 40000);
  EXPECT_EQ(f[0], 0.0);
  EXPECT_EQ(f[2], 0.0);
  EXPECT_NEAR(f[1], 0.5 / 0.8, 0.01);
}

TEST(Sampler, SameSeedSameTokens) {
  Tensor l = logits_of({0.25f, 0.25f, 0.25f, 0.25f});
  Sampler a({1.f, 0, 1.f, 77}), b({1.f, 0, 1.f, 77});
  for (int i = 0; i < 100; ++i) EXPECT_EQ(a.sample(l), b.sample(l));
}

TEST(Sampler, BadParametersThrow) {
  EXPECT_THROW(Sampler({-1.f, 0, 1.f, 0}), Error);
  EXPECT_THROW(Sampler({1.f, -3, 1.f, 0}), Error);
  EXPECT_THROW(Sampler({1.f, 0, 0.f, 0}), Error);
  EXPECT_THROW(Sampler({1.f, 0, 1.5f, 0}), Error);
  Sampler s({});
  EXPECT_THROW(s.sample(Tensor::zeros({2, 3}, DType::kF32)), Error);
}

}  // namespace
}  // namespace tessera::infer
