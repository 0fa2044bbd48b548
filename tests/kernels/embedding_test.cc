// embedding.h: lookup and scatter-add gradient against the scalar reference (bit-exact:
// both sum in token order), with repeated ids, strided tables and outputs, bf16
// weights, the adjoint identity, and id validation.
#include "tessera/kernels/embedding.h"

#include <gtest/gtest.h>

#include "pointwise_test_util.h"
#include "tessera/kernels/reference/embedding_ref.h"

namespace tessera::kernels {
namespace {

using namespace test_util;
namespace ref = reference;

Tensor random_ids(int64_t n, int32_t vocab, std::mt19937& rng) {
  std::uniform_int_distribution<int32_t> u(0, vocab - 1);
  std::vector<int32_t> v(n);
  for (auto& x : v) x = u(rng);
  return Tensor::from_vector(v, {n});
}

TEST(EmbeddingTest, MatchesReference) {
  std::mt19937 rng(41);
  const int32_t V = 13;  // small vocab: ids repeat a lot
  for (cpu::Isa isa : isas_to_test())
    for (DType dt : {DType::kF32, DType::kBF16})
      for (int64_t n : test_rows())
        for (int64_t h : test_cols())
          for (bool strided : {false, true}) {
            SCOPED_TRACE(std::string(isa_name(isa)) + " " + dtype_name(dt) + " N=" +
                         std::to_string(n) + " H=" + std::to_string(h) +
                         (strided ? " strided" : ""));
            ScopedIsa scoped(isa);
            Mat wf = random_mat(V, h, rng, strided);
            Tensor w = dt == DType::kF32 ? wf.view : wf.buf.to(dt);
            if (dt != DType::kF32 && strided) w = w.slice(1, 3, 3 + h);
            Tensor ids = random_ids(n, V, rng);
            Mat out = random_mat(n, h, rng, strided);
            Tensor want = out.view.clone();
            for (bool acc : {false, true}) {
              embedding_forward(w, ids, out.view, acc);
              ref::embedding_forward(w, ids, want, acc);
              EXPECT_TRUE(bitwise_equal(out.view, want)) << "accumulate=" << acc;
            }
            Mat dw = random_mat(V, h, rng, strided);
            Tensor want_dw = dw.view.clone();
            embedding_backward(out.view, ids, dw.view);
            ref::embedding_backward(out.view, ids, want_dw);
            EXPECT_TRUE(bitwise_equal(dw.view, want_dw));
          }
}

// Big enough to split the hidden dim across threads, with heavy id repetition.
TEST(EmbeddingTest, BackwardWithRepeatsIsExactWhenThreaded) {
  std::mt19937 rng(42);
  const int64_t N = 4096, H = 272;
  Tensor ids = random_ids(N, 7, rng);
  Tensor dout = random_mat(N, H, rng, false).view;
  Tensor dw = Tensor::zeros({7, H}, DType::kF32), want = dw.clone();
  embedding_backward(dout, ids, dw);
  ref::embedding_backward(dout, ids, want);
  EXPECT_TRUE(bitwise_equal(dw, want));
}

// <E(w), g> == <w, E^T(g)>: the backward is the forward's transpose.
TEST(EmbeddingTest, BackwardIsAdjointOfForward) {
  std::mt19937 rng(43);
  const int64_t N = 50, H = 24, V = 9;
  Tensor w = random_mat(V, H, rng, false).view, g = random_mat(N, H, rng, false).view;
  Tensor ids = random_ids(N, V, rng);
  Tensor e = Tensor::empty({N, H}, DType::kF32), dw = Tensor::zeros({V, H}, DType::kF32);
  embedding_forward(w, ids, e);
  embedding_backward(g, ids, dw);
  double lhs = 0, rhs = 0;
  const auto ev = values(e), gv = values(g), wv = values(w), dv = values(dw);
  for (size_t i = 0; i < ev.size(); ++i) lhs += static_cast<double>(ev[i]) * gv[i];
  for (size_t i = 0; i < wv.size(); ++i) rhs += static_cast<double>(wv[i]) * dv[i];
  EXPECT_NEAR(lhs, rhs, 1e-4 * (std::fabs(lhs) + 1));
}

TEST(EmbeddingTest, BadIdsThrowBeforeWriting) {
  Tensor w = Tensor::zeros({50, 4}, DType::kF32);
  Tensor out = Tensor::zeros({3, 4}, DType::kF32);
  out.fill(7.f);
  Tensor ids = Tensor::from_vector(std::vector<int32_t>{1, 2, 70000}, {3});
  EXPECT_TRUE(throws_error([&] { embedding_forward(w, ids, out); },
                           {"embedding_forward", "ids[2] = 70000", "vocab size 50"}));
  for (float v : values(out)) EXPECT_EQ(v, 7.f);
  Tensor neg = Tensor::from_vector(std::vector<int32_t>{-1, 2, 3}, {3});
  EXPECT_TRUE(throws_error([&] { embedding_backward(out, neg, w); },
                           {"embedding_backward", "ids[0] = -1", "vocab size 50"}));
  EXPECT_TRUE(throws_error(
      [&] { embedding_forward(w, Tensor::zeros({3}, DType::kI64), out); }, {"ids", "i32"}));
  EXPECT_TRUE(throws_error(
      [&] { embedding_forward(w, Tensor::zeros({2}, DType::kI32), out); }, {"ids", "(2,)", "(3,)"}));
  Tensor wide = Tensor::zeros({3, 5}, DType::kF32);
  EXPECT_TRUE(throws_error([&] { embedding_forward(w, ids, wide); }, {"hidden size"}));
  EXPECT_TRUE(throws_error(
      [&] { embedding_forward(Tensor::zeros({50, 4}, DType::kI8), ids, out); },
      {"weight", "f32 or bf16"}));
}

}  // namespace
}  // namespace tessera::kernels
