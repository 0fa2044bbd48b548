// cross_entropy_columns (vocabulary-major logits) against the scalar reference over the
// transposed logits: odd shapes, GPT-2's vocabulary (several blocks), ignored targets,
// extreme logits, f32 in place and bf16 exps (one rounding of the f32 value), and bf16
// logits (the native head's: the reference gets the same rounded values) with the bf16
// exps written over them; the gradient rebuilt from the factors the kernel returns.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "pointwise_test_util.h"
#include "tessera/kernels/cross_entropy.h"
#include "tessera/kernels/reference/cross_entropy_ref.h"

namespace tessera::kernels {
namespace {

using namespace test_util;

Tensor targets_for(int64_t n, int64_t vocab, std::mt19937& rng) {
  std::uniform_int_distribution<int32_t> u(0, static_cast<int32_t>(vocab - 1));
  std::vector<int32_t> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = i % 5 == 3 ? kIgnoreIndex : u(rng);
  return Tensor::from_vector(v, {n});
}

// dlogits_t from the kernel's factors: exps * col_scale - grad_scale at the target.
std::vector<double> gradient_of(const Tensor& exps, const Tensor& k, const Tensor& targets, float scale) {
  const int64_t V = exps.size(0), N = exps.size(1);
  const auto e = values(exps.to(DType::kF32)), ks = values(k);
  const int32_t* t = targets.data<int32_t>();
  std::vector<double> g(V * N);
  for (int64_t v = 0; v < V; ++v)
    for (int64_t n = 0; n < N; ++n) g[v * N + n] = double(e[v * N + n]) * ks[n] - (t[n] == v ? scale : 0.f);
  return g;
}

// logits (N, V) are the reference's; the kernel gets their transpose (in logits_dtype:
// bf16 logits are rounded first, and the reference sees the same rounded values).
void check(const Tensor& logits_in, const Tensor& targets, DType exps_dtype, bool in_place,
           DType logits_dtype = DType::kF32) {
  const Tensor logits = logits_dtype == DType::kBF16 ? bf16_rounded(logits_in) : logits_in;
  const int64_t N = logits.size(0), V = logits.size(1);
  const float scale = 1.0f / static_cast<float>(N);
  Tensor want_d = Tensor::empty({N, V}, DType::kF32);
  const CrossEntropyResult want = reference::cross_entropy(logits, targets, nullptr, &want_d, scale);
  Tensor xt = logits.transpose(0, 1).contiguous().clone();  // (N = 1: contiguous() is a view)
  if (logits_dtype == DType::kBF16) xt = xt.to(DType::kBF16);
  Tensor e = in_place ? xt : Tensor::empty({V, N}, exps_dtype);
  Tensor k = Tensor::empty({N}, DType::kF32);
  const CrossEntropyResult got = cross_entropy_columns(xt, targets, scale, &e, &k);
  EXPECT_EQ(got.count, want.count);
  EXPECT_NEAR(got.loss_sum, want.loss_sum, 1e-5 * std::max<int64_t>(1, want.count));
  Tensor xt2 = logits.transpose(0, 1).contiguous();
  if (logits_dtype == DType::kBF16) xt2 = xt2.to(DType::kBF16);
  const CrossEntropyResult loss_only = cross_entropy_columns(xt2, targets, scale, nullptr, nullptr);
  EXPECT_EQ(loss_only.loss_sum, got.loss_sum);
  const auto g = gradient_of(e, k, targets, scale);
  const auto w = values(want_d);
  // f32: the reference's tolerance; bf16 exps: one rounding (2^-9 relative) of the softmax part.
  const double rel = exps_dtype == DType::kBF16 && (!in_place || logits_dtype == DType::kBF16) ? 1.0 / 256 : 1e-5;
  int bad = 0;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t v = 0; v < V; ++v) {
      const double a = g[v * N + n], b = w[n * V + v];
      if (std::abs(a - b) > rel * std::abs(b) + 1e-7 * scale && ++bad <= 5)
        ADD_FAILURE() << "d[" << v << "][" << n << "] = " << a << ", reference " << b;
    }
  EXPECT_EQ(bad, 0);
}

TEST(CrossEntropyColumnsTest, MatchesReference) {
  std::mt19937 rng(61);
  for (cpu::Isa isa : isas_to_test())
    for (int64_t n : test_rows())
      for (int64_t v : test_cols()) {
        SCOPED_TRACE(std::string(isa_name(isa)) + " N=" + std::to_string(n) + " V=" + std::to_string(v));
        ScopedIsa scoped(isa);
        Tensor logits = random_mat(n, v, rng, false, -8.f, 8.f).view;
        Tensor targets = targets_for(n, v, rng);
        check(logits, targets, DType::kF32, false);
        check(logits, targets, DType::kBF16, false);
        check(logits, targets, DType::kF32, /*in_place=*/true);
        check(logits, targets, DType::kBF16, /*in_place=*/true, DType::kBF16);
        check(logits, targets, DType::kF32, false, DType::kBF16);
      }
}

TEST(CrossEntropyColumnsTest, GptVocabularyAcrossBlocks) {
  std::mt19937 rng(62);
  for (cpu::Isa isa : isas_to_test())
    for (int64_t n : {int64_t{5}, int64_t{37}}) {
      SCOPED_TRACE(std::string(isa_name(isa)) + " N=" + std::to_string(n));
      ScopedIsa scoped(isa);
      Tensor logits = random_mat(n, 50257, rng, false, -15.f, 15.f).view;
      Tensor targets = targets_for(n, 50257, rng);
      check(logits, targets, DType::kBF16, false);
      check(logits, targets, DType::kF32, true);
      check(logits, targets, DType::kBF16, true, DType::kBF16);
    }
}

TEST(CrossEntropyColumnsTest, ExtremeLogitsAndIgnoredTokens) {
  const float inf = std::numeric_limits<float>::infinity();
  // Tokens are columns: token 0 has logits (1e4, -1e4, 0), token 1 (3, -inf, 2), token 2 ignored.
  Tensor xt = Tensor::from_vector(std::vector<float>{1e4f, 3.f, 1.f, -1e4f, -inf, 2.f, 0.f, 2.f, 3.f}, {3, 3});
  Tensor targets = Tensor::from_vector(std::vector<int32_t>{1, 2, kIgnoreIndex}, {3});
  for (cpu::Isa isa : isas_to_test()) {
    ScopedIsa scoped(isa);
    Tensor e = Tensor::empty({3, 3}, DType::kF32), k = Tensor::empty({3}, DType::kF32);
    const auto r = cross_entropy_columns(xt, targets, 1.f, &e, &k);
    EXPECT_EQ(r.count, 2);
    const double l1 = 1 + std::log(1 + std::exp(-1.0));  // lse(3, 2) - 2
    EXPECT_NEAR(r.loss_sum, 2e4 + l1, 1e-2);
    const auto g = gradient_of(e, k, targets, 1.f);
    EXPECT_NEAR(g[0], 1.f, 1e-6);   // token 0: softmax (1, 0, 0) - onehot(1)
    EXPECT_NEAR(g[3], -1.f, 1e-6);
    EXPECT_NEAR(g[6], 0.f, 1e-6);
    EXPECT_EQ(g[4], 0.f);           // token 1's -inf logit
    for (int v = 0; v < 3; ++v) EXPECT_EQ(g[v * 3 + 2], 0.f) << "ignored token, row " << v;
  }
}

TEST(CrossEntropyColumnsTest, BadArgumentsThrow) {
  Tensor xt = Tensor::zeros({4, 2}, DType::kF32);
  Tensor bad = Tensor::from_vector(std::vector<int32_t>{0, 4}, {2});
  EXPECT_TRUE(throws_error([&] { cross_entropy_columns(xt, bad, 1.f, nullptr, nullptr); }, {"out of range"}));
  Tensor ok = Tensor::from_vector(std::vector<int32_t>{0, 3}, {2});
  Tensor wrong = Tensor::empty({2, 4}, DType::kF32), k = Tensor::empty({2}, DType::kF32);
  EXPECT_TRUE(throws_error([&] { cross_entropy_columns(xt, ok, 1.f, &wrong, &k); }, {"expected"}));
  EXPECT_TRUE(throws_error([&] { cross_entropy_columns(xt, ok, 1.f, &k, nullptr); }, {"go together"}));
}

}  // namespace
}  // namespace tessera::kernels
