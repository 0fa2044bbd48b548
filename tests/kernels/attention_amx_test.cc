// Attention with bf16 products on AMX tiles (AttentionParams::bf16_products), and the tile
// products themselves: against the double-precision reference run on the same operands
// rounded to bf16. Skipped where the CPU has no AMX (or TESSERA_ISA caps it): there the
// f32 kernels run, which tests/kernels/attention_test.cc covers.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <sstream>
#include <tuple>
#include <vector>

#include "tessera/kernels/attention.h"
#include "tessera/kernels/cpu/amx_tiles.h"
#include "tessera/kernels/cpu/attention_amx.h"
#include "tessera/kernels/dispatch.h"
#include "tessera/kernels/reference/attention_ref.h"
#include "tessera/tensor/dtype.h"

namespace tessera::kernels {
namespace {

#define SKIP_WITHOUT_AMX() \
  if (!cpu_has(IsaLevel::kAmx)) GTEST_SKIP() << "no AMX here (or TESSERA_ISA caps it): the f32 kernels run instead"

float bf16_round(float x) { return bf16_to_f32(f32_to_bf16(x)); }

// C = A B with A (M x K) and B (K x N) given as bf16 values: A as rows, B in VNNI pairs.
TEST(AmxTiles, ProductsEqualTheRoundedReference) {
  SKIP_WITHOUT_AMX();
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  for (auto [M, N, K] : {std::array<int64_t, 3>{16, 16, 32}, {32, 64, 64}, {48, 80, 96}, {64, 16, 128}}) {
    std::vector<float> a(M * K), b(K * N), want(M * N, 0.f);
    for (float& x : a) x = u(rng);
    for (float& x : b) x = u(rng);
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) {
        double s = 0;
        for (int64_t k = 0; k < K; ++k) s += double(bf16_round(a[i * K + k])) * bf16_round(b[k * N + j]);
        want[i * N + j] = static_cast<float>(s) + 1.f;  // + the accumulated c below
      }
    std::vector<uint16_t> pa(M * K), pb(K * N), pbt(K * N);
    cpu::amx_pack_rows(a.data(), K, M, K, pa.data(), M, K);
    cpu::amx_pack_vnni(b.data(), N, K, N, pb.data(), K, N);
    // The same B from its transpose (N x K): x^T's packing.
    std::vector<float> bt(N * K);
    for (int64_t k = 0; k < K; ++k)
      for (int64_t j = 0; j < N; ++j) bt[j * K + k] = b[k * N + j];
    cpu::amx_pack_vnni_transposed(bt.data(), K, N, K, pbt.data(), K, N);
    EXPECT_EQ(pb, pbt) << M << "x" << N << "x" << K;
    // A from a's transpose (K x M) packed transposed: the same rows as a packed directly.
    std::vector<float> at(K * M);
    for (int64_t i = 0; i < M; ++i)
      for (int64_t k = 0; k < K; ++k) at[k * M + i] = a[i * K + k];
    std::vector<uint16_t> pat(M * K);
    cpu::amx_pack_rows_transposed(at.data(), M, K, M, pat.data(), M, K);
    EXPECT_EQ(pa, pat) << M << "x" << N << "x" << K;
    std::vector<float> c(M * N, 1.f);
    const cpu::AmxTileScope tiles;
    cpu::amx_gemm_bf16(M, N, K, pa.data(), K, pb.data(), 2 * N, c.data(), N, true);
    for (int64_t i = 0; i < M * N; ++i)
      ASSERT_NEAR(c[i], want[i], 1e-4 * (1 + std::fabs(want[i]))) << M << "x" << N << "x" << K << " at " << i;
  }
}

struct Config {
  int64_t B, Tq, Tk, Hq, Hkv, D;
  bool causal;
  int64_t q_offset = 0, window = 0;
  float softcap = 0.f;
};

Tensor random(const Shape& s, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  Tensor t = Tensor::empty(s, DType::kF32);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = u(rng);
  return t;
}
Tensor rounded(const Tensor& t) { return t.to(DType::kBF16).to(DType::kF32); }

// |got - want| <= tol * max |want| everywhere.
void expect_close(const Tensor& got, const Tensor& want, float tol, const std::string& what) {
  const auto g = got.to_f32_vector(), w = want.to_f32_vector();
  float mx = 0.f, err = 0.f;
  for (float x : w) mx = std::max(mx, std::fabs(x));
  for (size_t i = 0; i < g.size(); ++i) err = std::max(err, std::fabs(g[i] - w[i]));
  EXPECT_LE(err, tol * mx) << what << ": max error " << err << " against max |want| " << mx;
}

TEST(AttentionAmx, Bf16ProductsMatchTheReferenceOnRoundedOperands) {
  SKIP_WITHOUT_AMX();
  const Config configs[] = {
      {2, 140, 140, 4, 2, 64, true},        {1, 129, 129, 12, 4, 64, true},
      {1, 200, 200, 2, 1, 32, true, 0, 50}, {2, 133, 133, 4, 2, 64, true, 0, 0, 5.f},
      {1, 37, 150, 8, 1, 128, false},       {1, 40, 300, 4, 2, 64, true, 260},
      {2, 1, 257, 8, 4, 64, true, 256},     {1, 300, 300, 8, 8, 96, true},
  };
  std::mt19937 rng(11);
  for (const Config& c : configs) {
    std::ostringstream name;
    name << "B=" << c.B << " Tq=" << c.Tq << " Tk=" << c.Tk << " Hq=" << c.Hq << " Hkv=" << c.Hkv << " D=" << c.D
         << (c.causal ? " causal" : " full") << " q_offset=" << c.q_offset << " window=" << c.window
         << " softcap=" << c.softcap;
    SCOPED_TRACE(name.str());
    const Tensor q = random({c.B, c.Tq, c.Hq, c.D}, rng), k = random({c.B, c.Tk, c.Hkv, c.D}, rng),
                 v = random({c.B, c.Tk, c.Hkv, c.D}, rng), dout = random({c.B, c.Tq, c.Hq, c.D}, rng);
    AttentionParams p;
    p.scale = 0.125f;  // a power of two: bf16(scale q) = scale bf16(q), as the reference sees it
    p.causal = c.causal, p.q_offset = c.q_offset, p.window = c.window, p.softcap = c.softcap;
    AttentionParams pb = p;
    pb.bf16_products = true;
    Tensor out = Tensor::empty(q.shape(), DType::kF32), lse = Tensor::empty({c.B, c.Hq, c.Tq}, DType::kF32);
    attention_forward(q, k, v, out, &lse, pb);
    Tensor dq = Tensor::empty(q.shape(), DType::kF32), dk = Tensor::empty(k.shape(), DType::kF32),
           dv = Tensor::empty(v.shape(), DType::kF32);
    attention_backward(q, k, v, out, lse, dout, dq, dk, dv, pb);

    const Tensor qr = rounded(q), kr = rounded(k), vr = rounded(v), dor = rounded(dout);
    Tensor out_ref = Tensor::empty(q.shape(), DType::kF32), lse_ref = Tensor::empty(lse.shape(), DType::kF32);
    reference::attention_forward(qr, kr, vr, out_ref, &lse_ref, p);
    Tensor dq_ref = Tensor::empty(q.shape(), DType::kF32), dk_ref = Tensor::empty(k.shape(), DType::kF32),
           dv_ref = Tensor::empty(v.shape(), DType::kF32);
    reference::attention_backward(qr, kr, vr, dor, dq_ref, dk_ref, dv_ref, p);
    // The scores are exact products of the rounded operands (f32 sums); the probabilities
    // and dS are rounded to bf16 before their products: a few parts in 1000.
    expect_close(lse, lse_ref, 1e-5f, "lse");
    expect_close(out, out_ref, 1e-2f, "out");
    expect_close(dq, dq_ref, 2e-2f, "dq");
    expect_close(dk, dk_ref, 2e-2f, "dk");
    expect_close(dv, dv_ref, 2e-2f, "dv");

    // And it is the bf16 path that ran: the f32 kernels on the unrounded operands differ.
    Tensor out32 = Tensor::empty(q.shape(), DType::kF32);
    attention_forward(q, k, v, out32, nullptr, p);
    EXPECT_NE(out.to_f32_vector(), out32.to_f32_vector());
  }
}

// Below cpu::kAmxMinKeys keys, at a head dim the tiles do not take, or with more query heads
// per kv head than a block's 32 tile rows, bf16_products runs
// the f32 kernels: the same bits as without it.
TEST(AttentionAmx, ShortSequencesAndOddHeadDimsStayOnTheF32Kernels) {
  SKIP_WITHOUT_AMX();
  std::mt19937 rng(5);
  // (T, D, query heads over 1 kv head): too few keys, an odd head dim, 64 query heads per kv head.
  for (auto [T, D, Hq] : {std::tuple<int64_t, int64_t, int64_t>{cpu::kAmxMinKeys - 1, 64, 4}, {200, 48, 4}, {150, 32, 64}}) {
    const Tensor q = random({1, T, Hq, D}, rng), k = random({1, T, 1, D}, rng), v = random({1, T, 1, D}, rng);
    AttentionParams p;
    p.scale = 0.125f;
    Tensor a = Tensor::empty(q.shape(), DType::kF32), b = Tensor::empty(q.shape(), DType::kF32);
    attention_forward(q, k, v, a, nullptr, p);
    p.bf16_products = true;
    attention_forward(q, k, v, b, nullptr, p);
    EXPECT_EQ(a.to_f32_vector(), b.to_f32_vector()) << "T " << T << " D " << D << " Hq " << Hq;
  }
}

}  // namespace
}  // namespace tessera::kernels
