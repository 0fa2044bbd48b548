// AWQ's scale and clip searches and SmoothQuant's smoothing factors, on calibration rows
// whose activations have a few outlier channels (as LLM activations do). Each output error
// is measured here directly on the rows, ||(W' - W) X^T||^2 in double over every row
// (not through the Gram matrix the searches use), and compared with round-to-nearest.
#include "tessera/kernels/awq.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>

namespace tessera::kernels {
namespace {

constexpr int64_t kN = 384, kOut = 48, kIn = 256;

// x (N, in): unit normal features, every 37th channel 25x larger.
Tensor activations(uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  Tensor x = Tensor::empty({kN, kIn}, DType::kF32);
  for (int64_t r = 0; r < kN; ++r)
    for (int64_t j = 0; j < kIn; ++j) x.data<float>()[r * kIn + j] = nd(rng) * (j % 37 == 5 ? 25.f : 1.f);
  return x;
}

Tensor weights(uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 0.05f);
  Tensor w = Tensor::empty({kOut, kIn}, DType::kF32);
  for (int64_t i = 0; i < w.numel(); ++i) w.data<float>()[i] = nd(rng);
  return w;
}

// sum over rows n and outputs o of (sum_k (a[o][k] - b[o][k]) x[n][k])^2.
double output_error(const Tensor& a, const Tensor& b, const Tensor& x) {
  const int64_t out = a.size(0), in = a.size(1), n = x.size(0);
  double e = 0;
  for (int64_t r = 0; r < n; ++r)
    for (int64_t o = 0; o < out; ++o) {
      double y = 0;
      for (int64_t k = 0; k < in; ++k)
        y += (static_cast<double>(a.data<float>()[o * in + k]) - b.data<float>()[o * in + k]) *
             x.data<float>()[r * in + k];
      e += y * y;
    }
  return e;
}

// The weights the model computes with after AWQ: Q(W diag s) diag(1/s).
Tensor awq_effective(const Tensor& w, const std::vector<float>& s, const AwqOptions& o) {
  Tensor d = dequantize(quantize_rtn(scale_columns(w, s), QuantScheme::kInt4, o.group, o.symmetric,
                                     o.f16_scales));
  for (int64_t r = 0; r < d.size(0); ++r)
    for (int64_t k = 0; k < d.size(1); ++k) d.data<float>()[r * d.size(1) + k] /= s[k];
  return d;
}

TEST(Awq, ScaleSearchProtectsTheSalientChannelsAndBeatsRoundToNearest) {
  const Tensor x = activations(1), w = weights(2);
  AwqOptions o;
  o.group = 64;
  const InputStats stats = input_stats(x);
  // The statistics the search reads, against their definitions.
  for (int64_t j : {0, 5, 42}) {
    double sum = 0, mx = 0;
    for (int64_t r = 0; r < kN; ++r) {
      sum += std::fabs(x.data<float>()[r * kIn + j]);
      mx = std::max<double>(mx, std::fabs(x.data<float>()[r * kIn + j]));
    }
    EXPECT_NEAR(stats.mean_abs[j], sum / kN, 1e-4 * sum / kN);
    EXPECT_EQ(stats.max_abs[j], static_cast<float>(mx));
  }
  const std::vector<float> s = awq_search_scales(w, stats, QuantScheme::kInt4, o);
  ASSERT_EQ(static_cast<int64_t>(s.size()), kIn);
  // The outlier channels get the largest scales.
  double outlier = 0, rest = 0;
  for (int64_t j = 0; j < kIn; ++j) (j % 37 == 5 ? outlier : rest) += s[j];
  EXPECT_GT(outlier / 7, 2 * rest / (kIn - 7));
  const Tensor rtn = dequantize(quantize_rtn(w, QuantScheme::kInt4, o.group, false, true));
  const double e_rtn = output_error(rtn, w, x), e_awq = output_error(awq_effective(w, s, o), w, x);
  std::printf("output error: rtn %.4e, awq scales %.4e (%.2fx)\n", e_rtn, e_awq, e_awq / e_rtn);
  EXPECT_LT(e_awq, 0.7 * e_rtn);
}

TEST(Awq, ScaleSearchNeverLosesToRoundToNearest) {
  // Isotropic activations: nothing to protect; plain RTN (s = 1) is a candidate, so the
  // result is at worst as good.
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  Tensor x = Tensor::empty({kN, kIn}, DType::kF32);
  for (int64_t i = 0; i < x.numel(); ++i) x.data<float>()[i] = nd(rng);
  const Tensor w = weights(4);
  AwqOptions o;
  o.group = 128;
  const auto s = awq_search_scales(w, input_stats(x), QuantScheme::kInt4, o);
  const Tensor rtn = dequantize(quantize_rtn(w, QuantScheme::kInt4, o.group, false, true));
  EXPECT_LE(output_error(awq_effective(w, s, o), w, x), output_error(rtn, w, x) * (1 + 1e-6));
}

TEST(Awq, ClipSearchLowersTheErrorAndLeavesOtherRows) {
  const Tensor x = activations(5);
  Tensor w = weights(6);
  // A few large weights per row: the range a group's 16 levels must cover.
  for (int64_t r = 0; r < kOut; ++r) w.data<float>()[r * kIn + (r * 7) % kIn] = 0.6f;
  AwqOptions o;
  o.group = 64;
  const InputStats stats = input_stats(x);
  Tensor clipped = w.clone();
  awq_clip(clipped, stats.gram, 8, kOut, QuantScheme::kInt4, o);
  int64_t changed = 0;
  for (int64_t r = 0; r < kOut; ++r)
    for (int64_t k = 0; k < kIn; ++k) {
      const float a = w.data<float>()[r * kIn + k], b = clipped.data<float>()[r * kIn + k];
      if (r < 8) {
        ASSERT_EQ(a, b) << "row " << r << " is outside the clipped rows";
      } else {
        ASSERT_LE(std::fabs(b), std::fabs(a));
        changed += a != b;
      }
    }
  EXPECT_GT(changed, 0);
  const auto q = [&](const Tensor& t) {
    return dequantize(quantize_rtn(t, QuantScheme::kInt4, o.group, false, true));
  };
  const double e_plain = output_error(q(w), w, x), e_clip = output_error(q(clipped), w, x);
  std::printf("output error: rtn %.4e, clipped %.4e (%.2fx)\n", e_plain, e_clip, e_clip / e_plain);
  EXPECT_LT(e_clip, e_plain);
}

TEST(SmoothQuant, FactorsFollowTheFormulaAndBalanceTheRanges) {
  const Tensor x = activations(7), w = weights(8);
  const InputStats stats = input_stats(x, /*with_gram=*/false);
  EXPECT_FALSE(stats.gram.defined());
  for (double alpha : {0.5, 0.8}) {
    const auto s = smoothquant_scales(w, stats.max_abs, alpha);
    for (int64_t j = 0; j < kIn; ++j) {
      double wmax = 0;
      for (int64_t r = 0; r < kOut; ++r) wmax = std::max<double>(wmax, std::fabs(w.data<float>()[r * kIn + j]));
      const double want = std::pow(stats.max_abs[j], alpha) / std::pow(wmax, 1 - alpha);
      ASSERT_NEAR(s[j], want, 1e-5 * want) << "alpha " << alpha << " channel " << j;
      // alpha = 0.5 makes max |x_j / s_j| equal max |w_j s_j|.
      if (alpha == 0.5) {
        ASSERT_NEAR(stats.max_abs[j] / s[j], wmax * s[j], 1e-4 * wmax * s[j]);
      }
    }
  }
  EXPECT_THROW(smoothquant_scales(w, stats.max_abs, 1.5), std::exception);
}

TEST(SmoothQuant, SmoothingLowersTheW8A8Error) {
  // Per-token int8 activations: one outlier channel sets every token's scale, so the
  // other channels lose their bits unless the outliers move into the weights.
  const Tensor x = activations(9), w = weights(10);
  const auto s = smoothquant_scales(w, input_stats(x, false).max_abs, 0.5);
  Tensor xs = x.clone();
  for (int64_t r = 0; r < kN; ++r)
    for (int64_t j = 0; j < kIn; ++j) xs.data<float>()[r * kIn + j] /= s[j];
  Tensor exact = Tensor::empty({kN, kOut}, DType::kF32), plain = exact.clone(), smooth = exact.clone();
  for (int64_t r = 0; r < kN; ++r)
    for (int64_t o = 0; o < kOut; ++o) {
      double y = 0;
      for (int64_t k = 0; k < kIn; ++k) y += static_cast<double>(w.data<float>()[o * kIn + k]) * x.data<float>()[r * kIn + k];
      exact.data<float>()[r * kOut + o] = static_cast<float>(y);
    }
  quant_matmul(x, quantize_rtn(w, QuantScheme::kW8A8, 0), plain);
  quant_matmul(xs, quantize_rtn(scale_columns(w, s), QuantScheme::kW8A8, 0), smooth);
  double e_plain = 0, e_smooth = 0;
  for (int64_t i = 0; i < exact.numel(); ++i) {
    e_plain += std::pow(plain.data<float>()[i] - exact.data<float>()[i], 2);
    e_smooth += std::pow(smooth.data<float>()[i] - exact.data<float>()[i], 2);
  }
  std::printf("W8A8 output error: plain %.4e, smoothed %.4e (%.2fx)\n", e_plain, e_smooth, e_smooth / e_plain);
  EXPECT_LT(e_smooth, 0.5 * e_plain);
}

}  // namespace
}  // namespace tessera::kernels
