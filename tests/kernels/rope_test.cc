// rope.h: the CPU kernel against the scalar reference on odd head layouts and strided
// QKV slices, a hand-computed example of the Hugging Face convention, inverse = adjoint,
// and argument checks.
#include "tessera/kernels/rope.h"

#include <gtest/gtest.h>

#include "pointwise_test_util.h"
#include "tessera/kernels/reference/rope_ref.h"

namespace tessera::kernels {
namespace {

using namespace test_util;

Tensor random_positions(int64_t n, std::mt19937& rng, int32_t max_pos) {
  std::uniform_int_distribution<int32_t> u(0, max_pos);
  std::vector<int32_t> p(n);
  for (auto& v : p) v = u(rng);
  return Tensor::from_vector(p, {n});
}

TEST(RopeTest, MatchesReference) {
  std::mt19937 rng(11);
  for (cpu::Isa isa : isas_to_test()) {
    ScopedIsa scoped(isa);
    for (int64_t n : test_rows())
      for (int64_t head_dim : {2, 16, 64, 80, 128})
        for (int64_t heads : {1, 3})
          for (bool strided : {false, true})
            for (float theta : {10000.f, 500000.f}) {
              SCOPED_TRACE(std::string(isa_name(isa)) + " N=" + std::to_string(n) +
                           " head_dim=" + std::to_string(head_dim) + " heads=" +
                           std::to_string(heads) + (strided ? " strided" : "") +
                           " theta=" + std::to_string(theta));
              const int64_t w = heads * head_dim;
              // strided: the K third of a fused (N, 3w) QKV buffer.
              Mat qkv = random_mat(n, strided ? 3 * w : w, rng, false);
              Tensor x = strided ? qkv.view.slice(1, w, 2 * w) : qkv.view;
              Tensor pos = random_positions(n, rng, 8191);
              Tensor want = x.clone();
              const Tensor before = qkv.view.clone();
              for (bool inverse : {false, true}) {
                rope_apply(x, head_dim, pos, theta, inverse);
                reference::rope_apply(want, head_dim, pos, theta, inverse);
                EXPECT_TRUE(all_close(x, want, 1e-5, 1e-6));
              }
              if (strided) {  // Q and V untouched
                EXPECT_TRUE(bitwise_equal(qkv.view.slice(1, 0, w), before.slice(1, 0, w)));
                EXPECT_TRUE(bitwise_equal(qkv.view.slice(1, 2 * w, 3 * w),
                                          before.slice(1, 2 * w, 3 * w)));
              }
            }
  }
}

// Scaled frequencies, an attention factor and a partial rotary (the first rotary_dim
// features of each head rotate, the rest stay as they were).
TEST(RopeTest, PartialRotaryAndAttentionFactorMatchReference) {
  std::mt19937 rng(12);
  for (cpu::Isa isa : isas_to_test()) {
    ScopedIsa scoped(isa);
    for (int64_t n : test_rows())
      for (auto [head_dim, rotary] : {std::pair<int64_t, int64_t>{64, 16}, {80, 40}, {128, 128}, {96, 34}}) {
        SCOPED_TRACE(std::string(isa_name(isa)) + " N=" + std::to_string(n) + " head_dim=" +
                     std::to_string(head_dim) + " rotary=" + std::to_string(rotary));
        RopeFreqs f = rope_default_freqs(rotary, 1e6f);
        for (size_t i = 0; i < f.inv_freq.size(); ++i) f.inv_freq[i] /= 1.0f + static_cast<float>(i % 3);
        f.attention_factor = 1.1386f;
        Mat m = random_mat(n, 3 * head_dim, rng, false);
        Tensor x = m.view, want = x.clone();
        const Tensor before = x.clone();
        Tensor pos = random_positions(n, rng, 40000);
        for (bool inverse : {false, true}) {
          rope_apply(x, head_dim, pos, f, inverse);
          reference::rope_apply(want, head_dim, pos, f, inverse);
          EXPECT_TRUE(all_close(x, want, 1e-5, 1e-5));
        }
        for (int64_t h = 0; h < 3; ++h)  // the features past rotary_dim untouched
          EXPECT_TRUE(bitwise_equal(x.slice(1, h * head_dim + rotary, (h + 1) * head_dim),
                                    before.slice(1, h * head_dim + rotary, (h + 1) * head_dim)));
      }
  }
  Tensor x = Tensor::zeros({2, 8}, DType::kF32);
  Tensor pos = Tensor::from_vector(std::vector<int32_t>{0, 1}, {2});
  EXPECT_TRUE(throws_error([&] { rope_apply(x, 4, pos, rope_default_freqs(8, 1e4f)); }, {"rotate 8", "head_dim 4"}));
  EXPECT_TRUE(throws_error([&] { rope_default_freqs(3, 1e4f); }, {"rotary dimension", "3"}));
}

// HF: inv_freq = [1, 1/100] for head_dim 4, theta 1e4; rotate_half pairs i with i + 2.
TEST(RopeTest, HandComputedExample) {
  Tensor x = Tensor::from_vector(std::vector<float>{1, 2, 3, 4, 1, 2, 3, 4}, {2, 4});
  Tensor pos = Tensor::from_vector(std::vector<int32_t>{0, 3}, {2});
  rope_apply(x, 4, pos, 10000.f);
  const auto v = values(x);
  const double c0 = std::cos(3.0), s0 = std::sin(3.0), c1 = std::cos(0.03), s1 = std::sin(0.03);
  const double want[8] = {1, 2, 3, 4, 1 * c0 - 3 * s0, 2 * c1 - 4 * s1, 3 * c0 + 1 * s0,
                          4 * c1 + 2 * s1};
  for (int i = 0; i < 8; ++i) EXPECT_NEAR(v[i], want[i], 2e-6) << "element " << i;
}

// The backward is the transpose rotation: <R x, y> == <x, R^T y>, and R^T R = I.
TEST(RopeTest, InverseIsAdjointAndUndoesForward) {
  std::mt19937 rng(12);
  for (cpu::Isa isa : isas_to_test()) {
    SCOPED_TRACE(isa_name(isa));
    ScopedIsa scoped(isa);
    const int64_t n = 9, head_dim = 48, heads = 2;
    Tensor x = random_mat(n, heads * head_dim, rng, false).view;
    Tensor y = random_mat(n, heads * head_dim, rng, false).view;
    Tensor pos = random_positions(n, rng, 100000);
    Tensor rx = x.clone(), rty = y.clone();
    rope_apply(rx, head_dim, pos, 1e6f);
    rope_apply(rty, head_dim, pos, 1e6f, /*inverse=*/true);
    double lhs = 0, rhs = 0;
    const auto a = values(rx), b = values(y), c = values(x), d = values(rty);
    for (size_t i = 0; i < a.size(); ++i) {
      lhs += static_cast<double>(a[i]) * b[i];
      rhs += static_cast<double>(c[i]) * d[i];
    }
    EXPECT_NEAR(lhs, rhs, 1e-4 * (std::fabs(lhs) + 1));
    rope_apply(rx, head_dim, pos, 1e6f, /*inverse=*/true);
    EXPECT_TRUE(all_close(rx, x, 1e-5, 1e-6));
  }
}

TEST(RopeTest, BadArgumentsThrow) {
  Tensor x = Tensor::zeros({3, 12}, DType::kF32);
  Tensor pos = Tensor::zeros({3}, DType::kI32);
  EXPECT_TRUE(throws_error([&] { rope_apply(x, 5, pos, 1e4f); }, {"rope_apply", "head_dim", "5"}));
  EXPECT_TRUE(throws_error([&] { rope_apply(x, 8, pos, 1e4f); }, {"not a multiple", "8"}));
  Tensor pos64 = Tensor::zeros({3}, DType::kI64);
  EXPECT_TRUE(throws_error([&] { rope_apply(x, 4, pos64, 1e4f); }, {"positions", "i32"}));
  Tensor pos2 = Tensor::zeros({2}, DType::kI32);
  EXPECT_TRUE(throws_error([&] { rope_apply(x, 4, pos2, 1e4f); }, {"positions", "(2,)", "(3,)"}));
  Tensor xt = Tensor::zeros({12, 3}, DType::kF32).transpose(0, 1);
  EXPECT_TRUE(throws_error([&] { rope_apply(xt, 4, pos, 1e4f); }, {"x", "contiguous last dim"}));
  EXPECT_TRUE(throws_error([&] { rope_apply(x, 4, pos, 0.f); }, {"theta"}));
}

}  // namespace
}  // namespace tessera::kernels
