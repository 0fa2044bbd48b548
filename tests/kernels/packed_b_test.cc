// Packed matmul weights: our packer against oneDNN's own reorder into BA16a64b2a, any
// partition of the rows, and products on packed weights against the plain ones.
#include "tessera/kernels/packed_b.h"

#include <gtest/gtest.h>
#include <oneapi/dnnl/dnnl.hpp>

#include <cstring>
#include <random>

#include "tessera/kernels/dispatch.h"
#include "tessera/kernels/matmul.h"

namespace tessera::kernels {
namespace {

Tensor random_bf16(int64_t rows, int64_t cols, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  std::vector<float> v(rows * cols);
  for (float& x : v) x = dist(rng);
  return Tensor::from_vector(v, {rows, cols}).to(DType::kBF16);
}

// oneDNN's reorder of op(b) (K, N), stored (K, N) or (N, K), into the blocked layout.
std::vector<uint16_t> onednn_packed(const Tensor& w, bool trans) {
  using dnnl::memory;
  const int64_t k = trans ? w.size(1) : w.size(0), n = trans ? w.size(0) : w.size(1);
  dnnl::engine eng(dnnl::engine::kind::cpu, 0);
  dnnl::stream s(eng);
  const memory::desc src_md = trans ? memory::desc({k, n}, memory::data_type::bf16, {1, k})
                                    : memory::desc({k, n}, memory::data_type::bf16, {n, 1});
  const memory::desc dst_md({k, n}, memory::data_type::bf16, memory::format_tag::BA16a64b2a);
  std::vector<uint16_t> out(dst_md.get_size() / 2, 0xFFFF);  // poison: the padding must be written 0
  memory src(src_md, eng, const_cast<void*>(w.raw_data())), dst(dst_md, eng, out.data());
  dnnl::reorder(src, dst).execute(s, src, dst);
  s.wait();
  return out;
}

std::vector<uint16_t> bits(const PackedB& p) {
  const auto* d = static_cast<const uint16_t*>(p.data.raw_data());
  return std::vector<uint16_t>(d, d + p.data.numel());
}

struct KN {
  int64_t k, n;
};
const KN kShapes[] = {{1, 1}, {7, 5}, {32, 64}, {33, 65}, {65, 130}, {100, 17}, {768, 96}, {129, 200}};

TEST(PackedB, LayoutEqualsOneDnnReorderInBothOrientations) {
  for (const KN s : kShapes)
    for (bool trans : {false, true}) {
      const Tensor w = trans ? random_bf16(s.n, s.k, 3) : random_bf16(s.k, s.n, 3);
      PackedB p;
      pack_b(w, trans, p);
      EXPECT_EQ(p.data.numel(), packed_b_elements(s.k, s.n));
      const std::vector<uint16_t> want = onednn_packed(w, trans);
      ASSERT_EQ(static_cast<size_t>(p.data.numel()), want.size()) << s.k << "x" << s.n;
      EXPECT_TRUE(bits(p) == want) << "K " << s.k << " N " << s.n << (trans ? " stored (N, K)" : " stored (K, N)");
      // The index function names the same positions.
      const auto* d = static_cast<const uint16_t*>(p.data.raw_data());
      const auto* src = static_cast<const uint16_t*>(w.raw_data());
      for (int64_t kk = 0; kk < s.k; ++kk)
        for (int64_t nn = 0; nn < s.n; ++nn)
          ASSERT_EQ(d[packed_b_index(kk, nn, s.k)], trans ? src[nn * s.k + kk] : src[kk * s.n + nn]);
    }
}

TEST(PackedB, AnyPartitionOfTheRowsGivesTheSameLayout) {
  std::mt19937 rng(11);
  for (const KN s : kShapes)
    for (bool trans : {false, true}) {
      // A strided source: columns [2, 2 + cols) of a wider matrix.
      const int64_t rows = trans ? s.n : s.k, cols = trans ? s.k : s.n;
      const Tensor wide = random_bf16(rows, cols + 3, 5);
      const Tensor w = wide.slice(1, 2, 2 + cols);
      PackedB whole, parts = packed_b_like(s.k, s.n, trans);
      pack_b(w.contiguous(), trans, whole);
      // Random cut points, packed in reverse order.
      std::vector<int64_t> cuts{0, rows};
      for (int i = 0; i < 4; ++i) cuts.push_back(std::uniform_int_distribution<int64_t>(0, rows)(rng));
      std::sort(cuts.begin(), cuts.end());
      for (size_t i = cuts.size() - 1; i > 0; --i)
        pack_b_rows(static_cast<const uint16_t*>(w.raw_data()), wide.stride(0), cuts[i - 1], cuts[i], parts);
      EXPECT_TRUE(bits(parts) == bits(whole)) << "K " << s.k << " N " << s.n << (trans ? " trans" : "");
    }
}

TEST(PackedB, ProductsEqualThePlainWeightsBitForBit) {
  if (!cpu_has(IsaLevel::kAvx512Bf16)) GTEST_SKIP() << "oneDNN multiplies bf16 natively only with AVX512-BF16 or AMX";
  struct Case {
    int64_t m, n, k;
  };
  // 300 rows: oneDNN gets two halves (matmul_onednn.cc); 1 and 7: decode-sized.
  for (const Case c : {Case{1, 65, 33}, Case{7, 129, 100}, Case{64, 96, 768}, Case{300, 200, 129}, Case{256, 64, 64}})
    for (bool trans : {false, true}) {
      const Tensor w = trans ? random_bf16(c.n, c.k, 1) : random_bf16(c.k, c.n, 1);
      PackedB p;
      pack_b(w, trans, p);
      const Tensor a = random_bf16(c.m, c.k, 2);
      const Tensor a32 = a.to(DType::kF32);
      const Tensor bias = random_bf16(1, c.n, 4).to(DType::kF32).view({c.n});
      Tensor want = random_bf16(c.m, c.n, 6).to(DType::kF32), got = want.clone();
      // c = a @ op(b) + 0.5 c
      matmul_with(MatmulBackend::kOneDnn, a, w, want, false, trans, 1.f, 0.5f);
      matmul_packed(a, p, got, nullptr, 0.5f);
      EXPECT_EQ(std::memcmp(want.raw_data(), got.raw_data(), want.numel() * 4), 0)
          << c.m << "x" << c.n << "x" << c.k << " beta";
      // With a bias in the epilogue, an f32 a (rounded), a bf16 c.
      matmul_bias_with(MatmulBackend::kOneDnn, a32, w, bias, want, trans);
      matmul_packed(a32, p, got, &bias);
      EXPECT_EQ(std::memcmp(want.raw_data(), got.raw_data(), want.numel() * 4), 0)
          << c.m << "x" << c.n << "x" << c.k << " bias";
      Tensor want16 = Tensor::empty({c.m, c.n}, DType::kBF16), got16 = want16.clone();
      matmul_with(MatmulBackend::kOneDnn, a, w, want16, false, trans, 1.f, 0.f);
      matmul_packed(a, p, got16);
      EXPECT_EQ(std::memcmp(want16.raw_data(), got16.raw_data(), want16.numel() * 2), 0)
          << c.m << "x" << c.n << "x" << c.k << " bf16 c";
    }
}

TEST(PackedB, BadArgumentsAreOneLineErrors) {
  const Tensor w = random_bf16(8, 4, 1);
  PackedB p;
  pack_b(w, false, p);
  Tensor c = Tensor::empty({3, 4}, DType::kF32);
  EXPECT_THROW(matmul_packed(random_bf16(3, 5, 1), p, c), Error);  // K 5 against 8
  Tensor wrong = Tensor::empty({3, 5}, DType::kF32);
  EXPECT_THROW(matmul_packed(random_bf16(3, 8, 1), p, wrong), Error);
  EXPECT_THROW(pack_b_rows(static_cast<const uint16_t*>(w.raw_data()), 4, 0, 9, p), Error);  // 9 rows of 8
  EXPECT_THROW(pack_b(w.to(DType::kF32), false, p), Error);
}

}  // namespace
}  // namespace tessera::kernels

namespace tessera::kernels {
namespace {

TEST(PackedB, PublishedElementRangesFillBothCopiesOfStackedWeights) {
  // Three stacked (40, 33) weights (an expert layer's), published in ranges that start and
  // end mid-row and cross from one weight into the next.
  const int64_t E = 3, rows = 40, cols = 33;
  const Tensor all = random_bf16(E * rows, cols, 9);
  std::vector<PackedB> fwd(E), dx(E), want_fwd(E), want_dx(E);
  PackTargets t;
  t.rows = rows, t.cols = cols;
  for (int64_t e = 0; e < E; ++e) {
    fwd[e] = packed_b_like(cols, rows, true);  // x W^T: stored (N, K)
    dx[e] = packed_b_like(rows, cols, false);  // dy W: stored (K, N)
    const Tensor w = all.slice(0, e * rows, (e + 1) * rows).contiguous();
    pack_b(w, true, want_fwd[e]);
    pack_b(w, false, want_dx[e]);
    t.fwd.push_back(&fwd[e]);
    t.dx.push_back(&dx[e]);
  }
  const auto* v = static_cast<const uint16_t*>(all.raw_data());
  const int64_t total = E * rows * cols;
  for (int64_t b = 0; b < total;) {
    const int64_t n = std::min<int64_t>(total - b, 17 * cols + 5);  // whole rows and parts of rows
    publish_packed(t, b, v + b, n);
    b += n;
  }
  for (int64_t e = 0; e < E; ++e) {
    EXPECT_TRUE(bits(fwd[e]) == bits(want_fwd[e])) << "expert " << e << " forward copy";
    EXPECT_TRUE(bits(dx[e]) == bits(want_dx[e])) << "expert " << e << " input-gradient copy";
  }
  EXPECT_THROW(publish_packed(t, total - 3, v, 4), Error);  // past the stack
}

}  // namespace
}  // namespace tessera::kernels
