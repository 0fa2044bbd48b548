// matmul backends (oneDNN, skinny, auto) against the double-accumulating reference.
#include "tessera/kernels/matmul.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>

#include "tessera/kernels/cpu/matmul_cpu.h"
#include "tessera/kernels/dispatch.h"
#include "tessera/kernels/reference/matmul_ref.h"

namespace tessera::kernels {
namespace {

struct Dims {
  int64_t m, n, k;
};

// Odd sizes on purpose: 1, 7, 129 and K not a multiple of 8 or 16 exercise every tail.
const Dims kShapes[] = {{1, 1, 1},   {1, 7, 129},  {7, 129, 7},  {129, 7, 33},
                        {3, 129, 17}, {4, 65, 100}, {5, 33, 47},  {64, 96, 80},
                        {1, 4096, 40}, {2, 300, 1029},
                        // 257-511 rows: a bf16 product goes to oneDNN in two halves (matmul_onednn.cc)
                        {300, 37, 65}};

Tensor random_tensor(int64_t rows, int64_t cols, DType dt, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  std::vector<float> v(rows * cols);
  for (float& x : v) x = dist(rng);
  return Tensor::from_vector(v, {rows, cols}).to(dt);
}

// A (rows, cols) view whose rows are strided: columns [3, 3 + cols) of a wider tensor.
Tensor strided_view(const Tensor& t) {
  Tensor wide = Tensor::empty({t.size(0), t.size(1) + 5}, t.dtype());
  wide.fill(std::numeric_limits<float>::quiet_NaN());  // poison: reading the gap shows up
  Tensor v = wide.slice(1, 3, 3 + t.size(1));
  v.copy_from(t);
  return v;
}

Tensor abs_of(const Tensor& t) {
  std::vector<float> v = t.contiguous().to_f32_vector();
  for (float& x : v) x = std::fabs(x);
  return Tensor::from_vector(v, t.shape()).to(t.dtype());
}

// Error bound scale per element: |alpha| * (|op(a)| @ |op(b)|) + |beta * c0|.
Tensor magnitude(const Tensor& a, const Tensor& b, const Tensor& c0, bool ta, bool tb,
                 float alpha, float beta) {
  Tensor mag = abs_of(c0);
  reference::matmul(abs_of(a), abs_of(b), mag, ta, tb, std::fabs(alpha), std::fabs(beta));
  return mag;
}

void expect_close(const Tensor& got, const Tensor& want, const Tensor& mag, float rtol,
                  const std::string& what) {
  const std::vector<float> g = got.contiguous().to_f32_vector();
  const std::vector<float> w = want.contiguous().to_f32_vector();
  const std::vector<float> s = mag.contiguous().to_f32_vector();
  ASSERT_EQ(g.size(), w.size());
  int bad = 0;
  for (size_t i = 0; i < g.size() && bad < 3; ++i) {
    const float tol = rtol * s[i] + 1e-6f;
    if (!(std::fabs(g[i] - w[i]) <= tol)) {
      ADD_FAILURE() << what << ": element " << i << " got " << g[i] << " want " << w[i]
                    << " tol " << tol;
      ++bad;
    }
  }
}

// bf16 operands are exact in f32 products, so only accumulation order differs from the
// reference; the looser bound covers vdpbf16ps's pairwise rounding.
float tolerance(DType a, DType b) {
  return a == DType::kF32 && b == DType::kF32 ? 1e-5f : 1e-4f;
}

struct Variant {
  bool strided;
  float alpha, beta;
};
// beta == 0 runs on a NaN-filled c: the backends must not read it.
const Variant kVariants[] = {{false, 1.f, 0.f}, {true, 0.75f, -1.5f}, {true, 1.f, 1.f}};

const MatmulBackend kBackends[] = {MatmulBackend::kOneDnn, MatmulBackend::kSkinny,
                                   MatmulBackend::kAuto};
const char* kBackendNames[] = {"onednn", "skinny", "auto"};

// One problem, every backend that accepts it, one reference (computed once: it
// dominates the test's run time).
void run_case(Dims d, DType da, DType db, bool ta, bool tb, Variant v, uint32_t seed) {
  Tensor a = random_tensor(ta ? d.k : d.m, ta ? d.m : d.k, da, seed);
  Tensor b = random_tensor(tb ? d.n : d.k, tb ? d.k : d.n, db, seed + 1);
  Tensor c0 = random_tensor(d.m, d.n, DType::kF32, seed + 2);
  if (v.beta == 0.f) c0.fill(std::numeric_limits<float>::quiet_NaN());
  if (v.strided) a = strided_view(a), b = strided_view(b);
  Tensor want = c0.clone();
  reference::matmul(a, b, want, ta, tb, v.alpha, v.beta);
  Tensor c0_for_mag = c0.clone();
  if (v.beta == 0.f) c0_for_mag.zero();
  const Tensor mag = magnitude(a, b, c0_for_mag, ta, tb, v.alpha, v.beta);
  for (int i = 0; i < 3; ++i) {
    if (kBackends[i] == MatmulBackend::kSkinny && !tb) continue;  // skinny needs a weight
    Tensor c = v.strided ? strided_view(c0) : c0.clone();
    matmul_with(kBackends[i], a, b, c, ta, tb, v.alpha, v.beta);
    const std::string what = std::string(kBackendNames[i]) + " M=" + std::to_string(d.m) +
                             " N=" + std::to_string(d.n) + " K=" + std::to_string(d.k) +
                             " a=" + dtype_name(da) + " b=" + dtype_name(db) +
                             " ta=" + std::to_string(ta) + " tb=" + std::to_string(tb) +
                             " strided=" + std::to_string(v.strided) +
                             " beta=" + std::to_string(v.beta);
    expect_close(c, want, mag, tolerance(da, db), what);
  }
}

const DType kDTypePairs[][2] = {{DType::kF32, DType::kF32},
                                {DType::kBF16, DType::kBF16},
                                {DType::kF32, DType::kBF16},
                                {DType::kBF16, DType::kF32}};

// Shapes x dtype pairs x transposes x (contiguous / strided, alpha, beta).
TEST(Matmul, EveryBackendMatchesReference) {
  uint32_t seed = 1;
  for (const Dims& d : kShapes)
    for (const auto& dt : kDTypePairs)
      for (int t = 0; t < 4; ++t)
        for (const Variant& v : kVariants) {
          run_case(d, dt[0], dt[1], t & 1, t & 2, v, seed += 3);
          if (::testing::Test::HasFailure()) return;
        }
}

// matmul_bias: the bias in oneDNN's epilogue (bf16 and f32 primitives), after sgemm, the
// skinny kernel and the widened path: every backend against the reference plus the bias.
TEST(Matmul, BiasInTheEpilogueMatchesReferencePlusBias) {
  uint32_t seed = 700;
  for (const Dims& d : kShapes)
    for (const auto& dt : kDTypePairs)
      for (bool tb : {false, true})
        for (bool strided : {false, true}) {
          Tensor a = random_tensor(d.m, d.k, dt[0], seed += 3);
          Tensor b = random_tensor(tb ? d.n : d.k, tb ? d.k : d.n, dt[1], seed + 1);
          const Tensor bias = random_tensor(1, d.n, DType::kF32, seed + 2).view({d.n});
          if (strided) a = strided_view(a), b = strided_view(b);
          Tensor want = Tensor::empty({d.m, d.n}, DType::kF32);
          reference::matmul(a, b, want, false, tb, 1.f, 0.f);
          float* w = want.data<float>();
          const float* bb = bias.data<float>();
          for (int64_t i = 0; i < d.m; ++i)
            for (int64_t j = 0; j < d.n; ++j) w[i * d.n + j] += bb[j];
          Tensor zero = Tensor::zeros({d.m, d.n}, DType::kF32);
          const Tensor mag = magnitude(a, b, zero, false, tb, 1.f, 0.f);
          for (int i = 0; i < 3; ++i) {
            if (kBackends[i] == MatmulBackend::kSkinny && !tb) continue;
            Tensor c = Tensor::empty({d.m, d.n}, DType::kF32);
            c.fill(std::numeric_limits<float>::quiet_NaN());  // beta 0: never read
            matmul_bias_with(kBackends[i], a, b, bias, c, tb);
            expect_close(c, want, mag, tolerance(dt[0], dt[1]),
                         std::string(kBackendNames[i]) + " bias M=" + std::to_string(d.m) + " N=" +
                             std::to_string(d.n) + " K=" + std::to_string(d.k) + " tb=" + std::to_string(tb));
          }
          if (::testing::Test::HasFailure()) return;
        }
  Tensor a = random_tensor(2, 3, DType::kF32, 1), b = random_tensor(3, 4, DType::kF32, 2);
  Tensor c = Tensor::empty({2, 4}, DType::kF32), wrong = Tensor::zeros({3}, DType::kF32);
  EXPECT_THROW(matmul_bias(a, b, wrong, c), Error);
}

// A bf16 c (the native head's logits): the f32 reference product rounded once to bf16,
// through every backend (oneDNN writes it; the others round an f32 product), with ta/tb
// and strided operands; the contract's limits are one-line errors.
TEST(Matmul, Bf16OutputIsTheProductRoundedOnce) {
  uint32_t seed = 900;
  for (const Dims& d : kShapes)
    for (bool ta : {false, true})
      for (bool tb : {false, true}) {
        Tensor a = strided_view(random_tensor(ta ? d.k : d.m, ta ? d.m : d.k, DType::kBF16, seed += 3));
        Tensor b = random_tensor(tb ? d.n : d.k, tb ? d.k : d.n, DType::kBF16, seed + 1);
        Tensor want = Tensor::empty({d.m, d.n}, DType::kF32);
        reference::matmul(a, b, want, ta, tb, 0.5f, 0.f);
        Tensor zero = Tensor::zeros({d.m, d.n}, DType::kF32);
        const Tensor mag = magnitude(a, b, zero, ta, tb, 0.5f, 0.f);
        for (int i = 0; i < 3; ++i) {
          if (kBackends[i] == MatmulBackend::kSkinny && !tb) continue;
          Tensor c = Tensor::empty({d.m, d.n}, DType::kBF16);
          matmul_with(kBackends[i], a, b, c, ta, tb, 0.5f, 0.f);
          // One bf16 rounding (2^-9 relative) on top of the f32 product's own tolerance.
          expect_close(c.to(DType::kF32), want, mag, 1.f / 256,
                       std::string(kBackendNames[i]) + " bf16 c M=" + std::to_string(d.m) + " N=" +
                           std::to_string(d.n) + " K=" + std::to_string(d.k));
        }
        if (::testing::Test::HasFailure()) return;
      }
  Tensor a16 = random_tensor(2, 3, DType::kBF16, 1), b16 = random_tensor(3, 4, DType::kBF16, 2);
  Tensor a32 = random_tensor(2, 3, DType::kF32, 3), c16 = Tensor::empty({2, 4}, DType::kBF16);
  EXPECT_THROW(matmul(a16, b16, c16, false, false, 1.f, 1.f), Error);  // beta: c is not read in bf16
  EXPECT_THROW(matmul(a32, b16, c16), Error);                          // an f32 operand
  EXPECT_THROW(matmul_bias(a16, b16, Tensor::zeros({4}, DType::kF32), c16), Error);
}

// The skinny kernel's instruction-set variants, each forced, including the AVX2 and
// scalar fallbacks that production on this CPU never reaches.
TEST(Matmul, SkinnyEveryIsaMatchesReference) {
  using cpu::SkinnyIsa;
  uint32_t seed = 1000;
  for (SkinnyIsa isa : {SkinnyIsa::kScalar, SkinnyIsa::kAvx2, SkinnyIsa::kAvx512}) {
    if (!cpu::skinny_isa_supported(isa)) continue;
    for (const Dims& d : {Dims{1, 7, 129}, Dims{4, 33, 31}, Dims{6, 9, 64}, Dims{3, 130, 8}, Dims{8, 37, 97},
                           Dims{7, 5, 33}, Dims{5, 11, 1500}})
      for (DType dt : {DType::kF32, DType::kBF16})
        for (bool ta : {false, true}) {
          Tensor a = strided_view(random_tensor(ta ? d.k : d.m, ta ? d.m : d.k, dt, ++seed));
          Tensor b = strided_view(random_tensor(d.n, d.k, dt, ++seed));
          Tensor c = strided_view(random_tensor(d.m, d.n, DType::kF32, ++seed));
          const Tensor c_init = c.clone();
          Tensor want = c.clone();
          reference::matmul(a, b, want, ta, true, 0.5f, 2.f);
          cpu::GemmArgs g;
          g.m = d.m, g.n = d.n, g.k = d.k;
          g.a = a.raw_data(), g.a_dtype = dt, g.lda = a.stride(0), g.trans_a = ta;
          g.b = b.raw_data(), g.b_dtype = dt, g.ldb = b.stride(0), g.trans_b = true;
          g.c = static_cast<float*>(c.raw_data()), g.ldc = c.stride(0);
          g.alpha = 0.5f, g.beta = 2.f;
          cpu::gemm_skinny(g, isa);
          expect_close(c, want, magnitude(a, b, c_init, ta, true, 0.5f, 2.f),
                       tolerance(dt, dt),
                       "isa " + std::to_string(static_cast<int>(isa)) + " M=" +
                           std::to_string(d.m));
        }
  }
}

// bf16 GEMMs widened to f32: weights converted in blocks of N (here 64 rows a block).
TEST(Matmul, WidenedBf16BlocksMatchReference) {
  uint32_t seed = 2000;
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      const Dims d{33, 150, 37};
      Tensor a = strided_view(random_tensor(ta ? d.k : d.m, ta ? d.m : d.k, DType::kBF16, ++seed));
      Tensor b = strided_view(random_tensor(tb ? d.n : d.k, tb ? d.k : d.n, DType::kBF16, ++seed));
      Tensor c = strided_view(random_tensor(d.m, d.n, DType::kF32, ++seed));
      const Tensor c_init = c.clone();
      Tensor want = c.clone();
      reference::matmul(a, b, want, ta, tb, 1.25f, -0.5f);
      cpu::GemmArgs g;
      g.m = d.m, g.n = d.n, g.k = d.k;
      g.a = a.raw_data(), g.a_dtype = DType::kBF16, g.lda = a.stride(0), g.trans_a = ta;
      g.b = b.raw_data(), g.b_dtype = DType::kBF16, g.ldb = b.stride(0), g.trans_b = tb;
      g.c = static_cast<float*>(c.raw_data()), g.ldc = c.stride(0);
      g.alpha = 1.25f, g.beta = -0.5f;
      cpu::gemm_onednn_widened(g, /*max_b_floats=*/1000);
      expect_close(c, want, magnitude(a, b, c_init, ta, tb, 1.25f, -0.5f), 1e-5f,
                   "widened ta=" + std::to_string(ta) + " tb=" + std::to_string(tb));
    }
}

TEST(Matmul, DecodeShapeThroughAuto) {
  Tensor x = random_tensor(1, 2048, DType::kF32, 7);    // (1, hidden)
  Tensor w = random_tensor(512, 2048, DType::kBF16, 8);  // (out, in) Linear weight
  Tensor y = Tensor::empty({1, 512}, DType::kF32);
  Tensor want = Tensor::zeros({1, 512}, DType::kF32);
  matmul(x, w, y, false, true);
  reference::matmul(x, w, want, false, true, 1.f, 0.f);
  expect_close(y, want, magnitude(x, w, Tensor::zeros({1, 512}, DType::kF32), false, true, 1, 0),
               1e-4f, "decode");
}

// Inside a DecodeRows scope a product of up to 8 rows with an f32 weight takes the skinny
// kernel: each row's result is then the same bits as that row alone (a decode row does not
// depend on the rows batched with it), and equals the reference. Outside the scope the limit
// stays kSkinnyMaxRows, so a prompt's rows keep oneDNN from 5 rows on.
TEST(Matmul, DecodeRowsSendUpToEightRowsToTheSkinnyKernel) {
  if (!cpu::skinny_isa_supported(cpu::SkinnyIsa::kAvx2)) GTEST_SKIP() << "no AVX2: oneDNN runs every product";
  EXPECT_FALSE(DecodeRows::active());
  EXPECT_EQ(skinny_max_rows(DType::kF32), kSkinnyMaxRows);
  const Tensor w = random_tensor(300, 1029, DType::kF32, 31);  // (out, in), K with a tail
  for (int64_t m : {5, 6, 8}) {
    const Tensor x = random_tensor(m, 1029, DType::kF32, 40 + static_cast<uint32_t>(m));
    Tensor batched = Tensor::empty({m, 300}, DType::kF32);
    Tensor want = Tensor::zeros({m, 300}, DType::kF32);
    reference::matmul(x, w, want, false, true, 1.f, 0.f);
    {
      DecodeRows decode;
      ASSERT_TRUE(DecodeRows::active());
      EXPECT_EQ(skinny_max_rows(DType::kF32), kSkinnyDecodeRows);
      matmul(x, w, batched, false, true);
    }
    expect_close(batched, want, magnitude(x, w, Tensor::zeros({m, 300}, DType::kF32), false, true, 1, 0), 1e-5f,
                 "decode rows M=" + std::to_string(m));
    for (int64_t r = 0; r < m; ++r) {
      Tensor alone = Tensor::empty({1, 300}, DType::kF32);
      matmul(x.slice(0, r, r + 1), w, alone, false, true);
      EXPECT_EQ(alone.to_f32_vector(), batched.slice(0, r, r + 1).to_f32_vector()) << "M=" << m << " row " << r;
    }
  }
  EXPECT_FALSE(DecodeRows::active());
  // bf16 weights: with AMX oneDNN keeps 5 rows and more; without it the skinny kernel does.
  {
    DecodeRows decode;
    EXPECT_EQ(skinny_max_rows(DType::kBF16), cpu_has(IsaLevel::kAmx) ? kSkinnyMaxRows : kSkinnyDecodeRows);
  }
}

TEST(Matmul, EmptyInnerDimScalesC) {
  Tensor a = Tensor::zeros({3, 0}, DType::kF32);
  Tensor b = Tensor::zeros({0, 4}, DType::kF32);
  Tensor c = Tensor::empty({3, 4}, DType::kF32);
  c.fill(2.f);
  matmul(a, b, c, false, false, 1.f, 0.5f);
  for (float v : c.to_f32_vector()) EXPECT_EQ(v, 1.f);
  c.fill(std::numeric_limits<float>::quiet_NaN());
  matmul(a, b, c, false, false, 1.f, 0.f);
  for (float v : c.to_f32_vector()) EXPECT_EQ(v, 0.f);
}

TEST(Matmul, OneDnnCachesPrimitives) {
  Tensor a = random_tensor(13, 11, DType::kF32, 1);
  Tensor b = random_tensor(11, 9, DType::kF32, 2);
  Tensor c = Tensor::empty({13, 9}, DType::kF32);
  matmul_with(MatmulBackend::kOneDnn, a, b, c, false, false, 0.25f, 0.f);
  const int64_t after_first = cpu::onednn_cache_size();
  matmul_with(MatmulBackend::kOneDnn, a, b, c, false, false, 0.25f, 0.f);
  EXPECT_EQ(cpu::onednn_cache_size(), after_first);
}

// Inside a VaryingShapes scope, products of every shape (both transposes of a and b, strided
// views, alpha, beta, a bias, a bf16 c) equal the reference, and they share one primitive per
// layout: a mixture-of-experts layer's row counts do not each create one.
TEST(Matmul, VaryingShapesEqualTheReferenceWithOnePrimitivePerLayout) {
  VaryingShapes varying;
  ASSERT_TRUE(VaryingShapes::active());
  int64_t created = 0;
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      const int64_t before = cpu::onednn_cache_size();
      for (int64_t m : {5, 17, 64, 250, 300, 257}) {
        const int64_t n = 33 + m % 7, k = 40 + m % 5;
        Tensor a = strided_view(random_tensor(ta ? k : m, ta ? m : k, DType::kBF16, static_cast<uint32_t>(m)));
        Tensor b = random_tensor(tb ? n : k, tb ? k : n, DType::kBF16, static_cast<uint32_t>(m + 1));
        Tensor c0 = random_tensor(m, n, DType::kF32, static_cast<uint32_t>(m + 2));
        Tensor c = strided_view(c0), want = c0.clone();
        matmul(a, b, c, ta, tb, 0.5f, 0.25f);
        reference::matmul(a, b, want, ta, tb, 0.5f, 0.25f);
        expect_close(c, want, magnitude(a, b, c0, ta, tb, 0.5f, 0.25f), 1e-5f,
                     "varying m=" + std::to_string(m) + " ta=" + std::to_string(ta) + " tb=" + std::to_string(tb));
      }
      created += cpu::onednn_cache_size() - before;
    }
  EXPECT_LE(created, 4) << "one primitive per (ta, tb) layout, whatever the shapes";
  // A bias in the epilogue, and a bf16 c.
  for (int64_t m : {9, 130}) {
    Tensor a = random_tensor(m, 48, DType::kBF16, 3), w = random_tensor(24, 48, DType::kBF16, 4);
    std::vector<float> bias_values(24);
    for (int j = 0; j < 24; ++j) bias_values[j] = 0.1f * static_cast<float>(j) - 1.f;
    Tensor bias = Tensor::from_vector(bias_values, {24});
    Tensor c = Tensor::empty({m, 24}, DType::kF32), want = Tensor::empty({m, 24}, DType::kF32);
    matmul_bias(a, w, bias, c, true);
    reference::matmul(a, w, want, false, true, 1.f, 0.f);
    std::vector<float> wv = want.to_f32_vector();
    const std::vector<float> bv = bias.to_f32_vector();
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < 24; ++j) wv[i * 24 + j] += bv[j];
    const Tensor wb = Tensor::from_vector(wv, {m, 24});
    expect_close(c, wb, magnitude(a, w, Tensor::zeros({m, 24}, DType::kF32), false, true, 1, 0), 1e-5f, "bias");
    Tensor c16 = Tensor::empty({m, 24}, DType::kBF16);
    matmul(a, w, c16, false, true);
    expect_close(c16.to(DType::kF32), want, magnitude(a, w, Tensor::zeros({m, 24}, DType::kF32), false, true, 1, 0),
                 1e-2f, "bf16 c");
  }
}

// The streamed product: blocks of rows through a cached scratch, written with streaming
// stores into c (a strided view here, so the rows start off 64-byte lines too), equal the
// reference for a row count that is not a multiple of the block, with b either way round.
TEST(Matmul, StreamedRowsEqualTheReference) {
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      const int64_t m = 1000, n = 37, k = 48;
      Tensor a = random_tensor(ta ? k : m, ta ? m : k, DType::kBF16, 11);
      Tensor b = random_tensor(tb ? n : k, tb ? k : n, DType::kBF16, 12);
      Tensor c = strided_view(Tensor::zeros({m, n}, DType::kF32)), want = Tensor::zeros({m, n}, DType::kF32);
      matmul_streamed_rows(a, b, c, ta, tb, 96);
      reference::matmul(a, b, want, ta, tb, 1.f, 0.f);
      expect_close(c, want, magnitude(a, b, Tensor::zeros({m, n}, DType::kF32), ta, tb, 1, 0), 1e-5f,
                   "streamed ta=" + std::to_string(ta) + " tb=" + std::to_string(tb));
    }
  Tensor a = random_tensor(8, 4, DType::kF32, 1), b = random_tensor(4, 3, DType::kF32, 2);
  Tensor c = Tensor::empty({8, 3}, DType::kF32);
  EXPECT_THROW(matmul_streamed_rows(a, b, c, false, false, 0), Error);
}

// Expects tessera::Error whose message contains `needle`.
template <typename Fn>
void expect_error(Fn fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one mentioning '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(Matmul, BadInputsThrow) {
  Tensor a = Tensor::zeros({4, 8}, DType::kF32);
  Tensor b = Tensor::zeros({8, 5}, DType::kF32);
  Tensor c = Tensor::zeros({4, 5}, DType::kF32);
  Tensor b_bad = Tensor::zeros({7, 5}, DType::kF32);
  expect_error([&] { matmul(a, b_bad, c); }, "f32(7, 5)");
  Tensor c_bad = Tensor::zeros({4, 6}, DType::kF32);
  expect_error([&] { matmul(a, b, c_bad); }, "f32(4, 6)");
  Tensor c_bf16 = Tensor::zeros({4, 5}, DType::kBF16);
  expect_error([&] { matmul(a, b, c_bf16); }, "c must be f32");
  Tensor a3 = Tensor::zeros({1, 4, 8}, DType::kF32);
  expect_error([&] { matmul(a3, b, c); }, "a must be 2-D");
  Tensor a_int = Tensor::zeros({4, 8}, DType::kI32);
  expect_error([&] { matmul(a_int, b, c); }, "a must be f32 or bf16");
  Tensor a_t = Tensor::zeros({8, 4}, DType::kF32).transpose(0, 1);  // last dim not contiguous
  expect_error([&] { matmul(a_t, b, c); }, "contiguous last dim");
  expect_error([&] { matmul_with(MatmulBackend::kSkinny, a, b, c, false, false, 1.f, 0.f); },
               "trans_b");
  Tensor big = Tensor::zeros({4, 13}, DType::kF32);
  Tensor a_alias = big.slice(1, 0, 8);
  Tensor c_alias = big.slice(1, 4, 9);
  expect_error([&] { matmul(a_alias, b, c_alias); }, "overlaps");
  Tensor c_beside = big.slice(1, 8, 13);  // interleaved rows, disjoint columns: fine
  EXPECT_NO_THROW(matmul(a_alias, b, c_beside));
  expect_error([&] { matmul(a, b, c, false, false, NAN, 0.f); }, "finite");
}

}  // namespace
}  // namespace tessera::kernels
