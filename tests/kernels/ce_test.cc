// cross_entropy.h: the fused kernel against the scalar reference (odd and GPT-2 / Llama
// vocab sizes, strided rows, ignored targets, in-place gradient), the gradient against
// double finite differences, the AVX-512 exp against std::exp, and target validation.
#include "tessera/kernels/cross_entropy.h"

#include <gtest/gtest.h>
#include <xmmintrin.h>

#include <limits>

#include "pointwise_test_util.h"
#include "tessera/kernels/cpu/avx2_math.h"
#include "tessera/kernels/cpu/avx512_math.h"
#include "tessera/kernels/dispatch.h"
#include "tessera/kernels/reference/cross_entropy_ref.h"

namespace tessera::kernels {
namespace {

using namespace test_util;
namespace ref = reference;

Tensor random_targets(int64_t n, int64_t vocab, std::mt19937& rng, bool with_ignored) {
  std::uniform_int_distribution<int32_t> u(0, static_cast<int32_t>(vocab - 1));
  std::vector<int32_t> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = (with_ignored && i % 5 == 3) ? kIgnoreIndex : u(rng);
  return Tensor::from_vector(v, {n});
}

// Runs kernel and reference on the same inputs and compares everything they return.
void check_against_reference(const Tensor& logits, const Tensor& targets, bool grad,
                             bool in_place) {
  const int64_t N = logits.size(0), V = logits.size(1);
  const float scale = 1.0f / static_cast<float>(N);
  Tensor losses = Tensor::empty({N}, DType::kF32), want_losses = losses.clone();
  Tensor want_d = Tensor::empty({N, V}, DType::kF32);
  const CrossEntropyResult want =
      ref::cross_entropy(logits, targets, &want_losses, grad ? &want_d : nullptr, scale);
  Tensor x = in_place ? logits : logits.clone();
  Tensor d = in_place ? x : Tensor::empty({N, V}, DType::kF32);
  const CrossEntropyResult got = cross_entropy(x, targets, &losses, grad ? &d : nullptr, scale);
  EXPECT_EQ(got.count, want.count);
  EXPECT_NEAR(got.loss_sum, want.loss_sum, 1e-5 * std::max<int64_t>(1, want.count));
  EXPECT_TRUE(all_close(losses, want_losses, 0, 1e-5));
  if (grad) {
    EXPECT_TRUE(all_close(d, want_d, 1e-5, 1e-7 * scale));
  }
}

TEST(CrossEntropyTest, MatchesReference) {
  std::mt19937 rng(51);
  for (cpu::Isa isa : isas_to_test())
    for (int64_t n : test_rows())
      for (int64_t v : test_cols())
        for (bool strided : {false, true}) {
          SCOPED_TRACE(std::string(isa_name(isa)) + " N=" + std::to_string(n) +
                       " V=" + std::to_string(v) + (strided ? " strided" : ""));
          ScopedIsa scoped(isa);
          Mat logits = random_mat(n, v, rng, strided, -8.f, 8.f);
          Tensor targets = random_targets(n, v, rng, true);
          for (bool grad : {false, true}) check_against_reference(logits.view, targets, grad, false);
          check_against_reference(logits.view, targets, true, /*in_place=*/true);
        }
}

TEST(CrossEntropyTest, LargeVocabularies) {
  std::mt19937 rng(52);
  for (cpu::Isa isa : isas_to_test())
    for (int64_t v : {32000, 50257}) {
      SCOPED_TRACE(std::string(isa_name(isa)) + " V=" + std::to_string(v));
      ScopedIsa scoped(isa);
      Mat logits = random_mat(3, v, rng, true, -15.f, 15.f);
      Tensor targets = random_targets(3, v, rng, false);
      check_against_reference(logits.view, targets, true, false);
      check_against_reference(logits.view, targets, true, /*in_place=*/true);
    }
}

TEST(CrossEntropyTest, IgnoredRowsAndExtremeLogits) {
  Tensor logits = Tensor::from_vector(
      std::vector<float>{1e4f, -1e4f, 0.f, 3.f, -std::numeric_limits<float>::infinity(), 2.f,
                         1.f, 2.f, 3.f},
      {3, 3});
  Tensor targets = Tensor::from_vector(std::vector<int32_t>{1, 2, kIgnoreIndex}, {3});
  Tensor losses = Tensor::empty({3}, DType::kF32), d = Tensor::empty({3, 3}, DType::kF32);
  const auto r = cross_entropy(logits, targets, &losses, &d, 1.f);
  EXPECT_EQ(r.count, 2);
  const auto l = values(losses), g = values(d);
  EXPECT_FLOAT_EQ(l[0], 2e4f);                     // -log softmax at a 2e4 gap
  const double l1 = 1 + std::log(1 + std::exp(-1.0));  // lse(3, 2) - 2; the -inf logit has p = 0
  EXPECT_NEAR(l[1], l1, 1e-6);
  EXPECT_EQ(l[2], 0.f);
  EXPECT_NEAR(r.loss_sum, 2e4 + l1, 1e-2);
  const float want_g[9] = {1, -1, 0, 0, 0, 0, 0, 0, 0};
  for (int i = 0; i < 3; ++i) EXPECT_NEAR(g[i], want_g[i], 1e-6) << i;
  EXPECT_EQ(g[4], 0.f);
  for (int i = 6; i < 9; ++i) EXPECT_EQ(g[i], 0.f);
  Tensor all_ignored = Tensor::from_vector(std::vector<int32_t>(3, kIgnoreIndex), {3});
  const auto z = cross_entropy(logits, all_ignored, nullptr, nullptr, 1.f);
  EXPECT_EQ(z.count, 0);
  EXPECT_EQ(z.loss_sum, 0.0);
}

TEST(CrossEntropyTest, GradientMatchesFiniteDifferences) {
  std::mt19937 rng(53);
  const int64_t N = 3, V = 11;
  const float scale = 0.25f;
  Tensor logits = random_mat(N, V, rng, false, -3.f, 3.f).view;
  Tensor targets = random_targets(N, V, rng, false);
  const auto xf = values(logits);
  std::vector<double> x(xf.begin(), xf.end());
  auto loss = [&](const std::vector<double>& v) {
    double L = 0;
    for (int64_t n = 0; n < N; ++n) {
      double mx = -1e300, s = 0;
      for (int64_t i = 0; i < V; ++i) mx = std::max(mx, v[n * V + i]);
      for (int64_t i = 0; i < V; ++i) s += std::exp(v[n * V + i] - mx);
      L += std::log(s) + mx - v[n * V + targets.data<int32_t>()[n]];
    }
    return scale * L;
  };
  std::vector<float> fd(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double keep = x[i], h = 1e-5;
    x[i] = keep + h;
    const double lp = loss(x);
    x[i] = keep - h;
    const double lm = loss(x);
    x[i] = keep;
    fd[i] = static_cast<float>((lp - lm) / (2 * h));
  }
  const Tensor want = Tensor::from_vector(fd, {N, V});
  Tensor d = Tensor::empty({N, V}, DType::kF32);
  ref::cross_entropy(logits, targets, nullptr, &d, scale);
  EXPECT_TRUE(all_close(d, want, 1e-4, 1e-6)) << "reference";
  cross_entropy(logits, targets, nullptr, &d, scale);
  EXPECT_TRUE(all_close(d, want, 1e-4, 1e-6)) << "kernel";
}

TESSERA_AVX512 void exp16(const float* x, float* y) {
  _mm512_storeu_ps(y, cpu::avx512::exp(_mm512_loadu_ps(x)));
}

TEST(CrossEntropyTest, Avx512ExpMatchesStdExp) {
  if (cpu::pointwise_isa() != cpu::Isa::kAvx512) GTEST_SKIP() << "no AVX-512 on this CPU";
  double worst = 0;
  float x[16], y[16];
  // Normal range: relative error. Stepping by an odd increment hits many reductions.
  for (double v = -87.0; v < 88.5; v += 16 * 1.37e-4) {
    for (int j = 0; j < 16; ++j) x[j] = static_cast<float>(v + j * 1.37e-4);
    exp16(x, y);
    for (int j = 0; j < 16; ++j) {
      const double want = std::exp(static_cast<double>(x[j]));
      worst = std::max(worst, std::fabs(y[j] - want) / want);
    }
  }
  EXPECT_LT(worst, 1.5e-7);  // exhaustive over all floats in [-87, 88]: 8.5e-8 (1.01 ulp)
  // Denormal results (0 when the process flushes subnormals, base/thread_pool.cc; else
  // within a denormal step), saturation and specials.
  const float inf = std::numeric_limits<float>::infinity();
  const float special[16] = {-95.f, -100.f, -103.9f, -104.f, -200.f, -inf, 88.7f, 89.f,
                             100.f,  inf,   0.f,     -0.f,   1.f,    -1.f, 1e-8f, NAN};
  exp16(special, y);
  const bool ftz = (_mm_getcsr() & 0x8000) != 0;
  for (int j = 0; j < 6; ++j) {
    if (ftz) {
      EXPECT_EQ(y[j], 0.f) << special[j];
      continue;
    }
    EXPECT_NEAR(y[j], std::exp(static_cast<double>(special[j])), 2e-45 + 1e-6 * std::exp(static_cast<double>(special[j])))
        << special[j];
  }
  EXPECT_NEAR(y[6] / std::exp(static_cast<double>(special[6])), 1.0, 3e-7);
  EXPECT_EQ(y[7], inf);
  EXPECT_EQ(y[8], inf);
  EXPECT_EQ(y[9], inf);
  EXPECT_EQ(y[10], 1.f);
  EXPECT_EQ(y[11], 1.f);
  EXPECT_NEAR(y[12], std::exp(1.0), 3e-7 * std::exp(1.0));
  EXPECT_NEAR(y[13], std::exp(-1.0), 3e-7 * std::exp(-1.0));
  EXPECT_FLOAT_EQ(y[14], 1.f);
  EXPECT_TRUE(std::isnan(y[15]));
}

TESSERA_AVX2_FMA void exp8(const float* x, float* y) {
  _mm256_storeu_ps(y, cpu::avx2::exp_or_zero(_mm256_loadu_ps(x)));
}

// The AVX2 tiles' exp (the AVX-512 one's polynomial, 2^n built in the exponent bits).
TEST(Attention, Avx2ExpMatchesStdExp) {
  if (!cpu_has(IsaLevel::kAvx2)) GTEST_SKIP() << "no AVX2 + FMA on this CPU";
  double worst = 0;
  float x[8], y[8];
  for (double v = -87.0; v < 88.5; v += 8 * 1.37e-4) {
    for (int j = 0; j < 8; ++j) x[j] = static_cast<float>(v + j * 1.37e-4);
    exp8(x, y);
    for (int j = 0; j < 8; ++j) {
      const double want = std::exp(static_cast<double>(x[j]));
      worst = std::max(worst, std::fabs(y[j] - want) / want);
    }
  }
  EXPECT_LT(worst, 1.5e-7);
  // Below -87.3 (a masked score's -inf included) and NaN: exactly 0; above 88.7: capped.
  const float inf = std::numeric_limits<float>::infinity();
  const float special[8] = {-87.31f, -200.f, -inf, NAN, 89.f, inf, 0.f, -87.29f};
  exp8(special, y);
  for (int j = 0; j < 4; ++j) EXPECT_EQ(y[j], 0.f) << special[j];
  EXPECT_NEAR(y[4] / std::exp(static_cast<double>(88.7f)), 1.0, 3e-7);
  EXPECT_NEAR(y[5] / std::exp(static_cast<double>(88.7f)), 1.0, 3e-7);
  EXPECT_EQ(y[6], 1.f);
  EXPECT_NEAR(y[7] / std::exp(static_cast<double>(special[7])), 1.0, 3e-7);
}

TEST(CrossEntropyTest, BadTargetsThrow) {
  Tensor logits = Tensor::zeros({4, 50257}, DType::kF32);
  Tensor bad = Tensor::from_vector(std::vector<int32_t>{0, 1, 2, 50257}, {4});
  EXPECT_TRUE(throws_error([&] { cross_entropy(logits, bad, nullptr, nullptr, 1.f); },
                           {"cross_entropy", "targets[3] = 50257", "vocab size 50257"}));
  Tensor neg = Tensor::from_vector(std::vector<int32_t>{0, -5, 2, 3}, {4});
  EXPECT_TRUE(throws_error([&] { cross_entropy(logits, neg, nullptr, nullptr, 1.f); },
                           {"targets[1] = -5"}));
  Tensor ok = Tensor::zeros({4}, DType::kI32);
  Tensor d = Tensor::zeros({4, 100}, DType::kF32);
  EXPECT_TRUE(throws_error([&] { cross_entropy(logits, ok, nullptr, &d, 1.f); },
                           {"dlogits", "(4, 100)", "(4, 50257)"}));
  Tensor l = Tensor::zeros({3}, DType::kF32);
  EXPECT_TRUE(throws_error([&] { cross_entropy(logits, ok, &l, nullptr, 1.f); },
                           {"losses", "(3,)"}));
  EXPECT_TRUE(throws_error(
      [&] { cross_entropy(logits, Tensor::zeros({4}, DType::kI64), nullptr, nullptr, 1.f); },
      {"targets", "i32"}));
}

}  // namespace
}  // namespace tessera::kernels
