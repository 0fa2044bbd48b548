// elementwise.h: add / bias / scale kernels against the scalar reference on odd and
// strided shapes (exact for the adds), collapsible 3-D views, thread-count independent
// bias gradients, and argument checks.
#include "tessera/kernels/elementwise.h"

#include <gtest/gtest.h>

#include "pointwise_test_util.h"
#include "tessera/base/thread_pool.h"
#include "tessera/kernels/reference/elementwise_ref.h"

namespace tessera::kernels {
namespace {

using namespace test_util;
namespace ref = reference;

template <typename Fn>
void for_each_case(Fn&& fn) {
  for (cpu::Isa isa : isas_to_test())
    for (int64_t n : test_rows())
      for (int64_t f : test_cols())
        for (bool strided : {false, true}) {
          SCOPED_TRACE(std::string(isa_name(isa)) + " N=" + std::to_string(n) +
                       " F=" + std::to_string(f) + (strided ? " strided" : ""));
          ScopedIsa scoped(isa);
          fn(n, f, strided);
        }
}

TEST(ElementwiseTest, MatchesReference) {
  std::mt19937 rng(31);
  for_each_case([&](int64_t n, int64_t f, bool strided) {
    Mat a = random_mat(n, f, rng, strided), b = random_mat(n, f, rng, strided);
    const Tensor pad_before = a.buf.clone();
    Tensor want = a.view.clone();
    add_inplace(a.view, b.view);
    ref::add_inplace(want, b.view);
    EXPECT_TRUE(bitwise_equal(a.view, want));
    if (strided) {
      EXPECT_TRUE(bitwise_equal(a.buf.slice(1, 0, 3), pad_before.slice(1, 0, 3)));
    }

    for (DType dt : {DType::kF32, DType::kBF16}) {
      Tensor bias = random_vec(f, rng, dt, -1.f, 1.f);
      add_bias(a.view, bias);
      ref::add_bias(want, bias);
      EXPECT_TRUE(bitwise_equal(a.view, want)) << dtype_name(dt);
    }

    Tensor db = random_vec(f, rng, DType::kF32, -1.f, 1.f), want_db = db.clone();
    bias_backward(b.view, db);
    ref::bias_backward(b.view, want_db);
    EXPECT_TRUE(all_close(db, want_db, 1e-5, 1e-5));

    Tensor c = a.view.clone(), want_c = c.clone();
    scale_inplace(c, 0.37f);
    ref::scale_inplace(want_c, 0.37f);
    EXPECT_TRUE(bitwise_equal(c, want_c));
  });
}

// (2, 3, F) views whose leading dims collapse into rows are accepted.
TEST(ElementwiseTest, CollapsibleThreeDimViews) {
  std::mt19937 rng(32);
  const int64_t F = 19;
  Tensor buf = random_mat(6, F + 4, rng, false).view;
  Tensor a = buf.view({2, 3, F + 4}).slice(2, 1, 1 + F);  // strided rows, 3-D
  Tensor b = random_mat(6, F, rng, false).view.view({2, 3, F});
  Tensor want = a.clone().view({6, F});
  add_inplace(a, b);
  ref::add_inplace(want, b.view({6, F}));
  EXPECT_TRUE(bitwise_equal(a.clone().view({6, F}), want));
  Tensor db = Tensor::zeros({F}, DType::kF32), want_db = db.clone();
  bias_backward(a, db);
  ref::bias_backward(want, want_db);
  EXPECT_TRUE(all_close(db, want_db, 1e-5, 1e-6));
  Tensor bad = Tensor::zeros({3, 2, F}, DType::kF32).transpose(0, 1);  // (2, 3, F), no row stride
  EXPECT_TRUE(throws_error([&] { add_inplace(bad, b); }, {"add_inplace", "a", "collapse"}));
}

TEST(ElementwiseTest, BiasGradientIsIndependentOfThreadCount) {
  std::mt19937 rng(33);
  Tensor dout = random_mat(4096, 80, rng, false).view;
  const int saved = base::num_threads();
  std::vector<Tensor> results;
  for (int threads : {1, 2, 4}) {
    base::set_num_threads(threads);
    Tensor db = Tensor::zeros({80}, DType::kF32);
    bias_backward(dout, db);
    results.push_back(db);
  }
  base::set_num_threads(saved);
  EXPECT_TRUE(bitwise_equal(results[1], results[0]));
  EXPECT_TRUE(bitwise_equal(results[2], results[0]));
}

TEST(ElementwiseTest, BadArgumentsThrow) {
  Tensor a = Tensor::zeros({4, 8}, DType::kF32);
  EXPECT_TRUE(throws_error([&] { add_inplace(a, Tensor::zeros({4, 7}, DType::kF32)); },
                           {"add_inplace", "(4, 7)", "(4, 8)"}));
  EXPECT_TRUE(throws_error([&] { add_bias(a, Tensor::zeros({7}, DType::kF32)); },
                           {"add_bias", "bias", "(7,)", "(8,)"}));
  EXPECT_TRUE(throws_error([&] { add_bias(a, Tensor::zeros({8}, DType::kI32)); },
                           {"bias", "f32 or bf16"}));
  Tensor db16 = Tensor::zeros({8}, DType::kBF16);
  EXPECT_TRUE(throws_error([&] { bias_backward(a, db16); }, {"bias_backward", "dbias"}));
  Tensor col = Tensor::zeros({4, 8}, DType::kF32).slice(1, 0, 4);
  EXPECT_TRUE(throws_error([&] { scale_inplace(col, 2.f); }, {"scale_inplace", "contiguous"}));
  Tensor at = Tensor::zeros({8, 4}, DType::kF32).transpose(0, 1);
  EXPECT_TRUE(throws_error([&] { add_inplace(at, a); }, {"a", "contiguous last dim"}));
}

}  // namespace
}  // namespace tessera::kernels
