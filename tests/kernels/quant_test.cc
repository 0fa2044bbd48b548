// Quantized weights: fp8 e4m3 codes against the format's formula, round-to-nearest
// quantization against its definition, and every product path (GEMV, blocked GEMM, auto)
// against the scalar reference and against dequantize-then-f32-GEMM, on odd shapes, per
// scheme and group size, with act-order permutations and smoothing, through every GEMV
// row kernel the CPU can run (scalar, AVX2, AVX-512, AVX-512 VNNI). The capped-ISA ctest
// runs (kernels_isa_avx2 / kernels_isa_scalar) take the same assertions down the AVX2
// and scalar kernels.
#include "tessera/kernels/quant.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "tessera/base/cpu_features.h"
#include "tessera/kernels/bf16_speed.h"
#include "tessera/kernels/cpu/quant_cpu.h"
#include "tessera/kernels/cpu/quant_rows.h"
#include "tessera/kernels/dispatch.h"
#include "tessera/kernels/matmul.h"
#include "tessera/kernels/reference/quant_ref.h"

namespace tessera::kernels {
namespace {

Tensor random_tensor(int64_t rows, int64_t cols, uint32_t seed, float lo = -1.f, float hi = 1.f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(rows * cols);
  for (float& x : v) x = dist(rng);
  return Tensor::from_vector(v, {rows, cols});
}

// e4m3 from its definition: (-1)^s 2^(e-7) (1 + m/8), subnormals 2^-6 (m/8).
double e4m3_formula(int code) {
  const int s = code >> 7, e = (code >> 3) & 15, m = code & 7;
  const double mag = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, e - 7);
  return s ? -mag : mag;
}

TEST(Fp8E4m3, EveryCodeDecodesByTheFormulaAndRoundTrips) {
  for (int c = 0; c < 256; ++c) {
    const float f = fp8_e4m3_to_f32(static_cast<uint8_t>(c));
    if ((c & 0x7F) == 0x7F) {
      EXPECT_TRUE(std::isnan(f)) << c;
      continue;
    }
    EXPECT_EQ(f, static_cast<float>(e4m3_formula(c))) << c;
    const uint8_t back = f32_to_fp8_e4m3(f);
    EXPECT_EQ(fp8_e4m3_to_f32(back), f) << c;  // +0 / -0 both fine
  }
  EXPECT_EQ(fp8_e4m3_to_f32(0x7E), 448.f);
  EXPECT_EQ(f32_to_fp8_e4m3(1e6f), 0x7E);   // saturates
  EXPECT_EQ(f32_to_fp8_e4m3(-1e6f), 0xFE);
}

TEST(Fp8E4m3, RoundsToNearestEven) {
  // Between every pair of neighbouring positive codes: the midpoint goes to the even code,
  // a point just off it to the nearer one.
  for (int c = 0; c < 0x7E; ++c) {
    const double a = e4m3_formula(c), b = e4m3_formula(c + 1), mid = (a + b) / 2;
    EXPECT_EQ(f32_to_fp8_e4m3(static_cast<float>(mid)), (c % 2 == 0) ? c : c + 1) << c;
    EXPECT_EQ(f32_to_fp8_e4m3(static_cast<float>(a + (b - a) * 0.3)), c) << c;
    EXPECT_EQ(f32_to_fp8_e4m3(static_cast<float>(a + (b - a) * 0.7)), c + 1) << c;
  }
}

TEST(QuantizeRtn, Int4GroupsFollowGptqsQuantizer) {
  const Tensor w = random_tensor(5, 256, 1, -0.3f, 0.7f);
  for (bool sym : {false, true}) {
    const QuantWeight q = quantize_rtn(w, QuantScheme::kInt4, 64, sym);
    q.validate("test");
    const Tensor d = dequantize(q);
    for (int64_t o = 0; o < 5; ++o)
      for (int64_t g = 0; g < 4; ++g) {
        const float* wg = w.data<float>() + o * 256 + g * 64;
        float lo = 0, hi = 0;
        for (int i = 0; i < 64; ++i) lo = std::min(lo, wg[i]), hi = std::max(hi, wg[i]);
        if (sym) hi = std::max(hi, -lo), lo = -hi;
        const float s = q.scales.data<float>()[o * 4 + g], z = q.zeros.data<float>()[o * 4 + g];
        EXPECT_FLOAT_EQ(s, (hi - lo) / 15.f);
        EXPECT_EQ(z, sym ? 8.f : std::nearbyint(-lo / s));
        for (int i = 0; i < 64; ++i) {
          const int qi = static_cast<int>(std::clamp(std::nearbyint(wg[i] / s) + z, 0.f, 15.f));
          EXPECT_FLOAT_EQ(d.data<float>()[o * 256 + g * 64 + i], s * (qi - z));
          if (!sym) {
            EXPECT_LE(std::fabs(d.data<float>()[o * 256 + g * 64 + i] - wg[i]), s / 2 + 1e-6f);
          }
        }
      }
  }
}

TEST(QuantizeRtn, Int8AndFp8AndW8a8ErrorsAreWithinHalfAStep) {
  const Tensor w = random_tensor(7, 100, 2);
  for (QuantScheme s : {QuantScheme::kInt8, QuantScheme::kFp8, QuantScheme::kW8A8}) {
    const QuantWeight q = quantize_rtn(w, s, 0, true);
    q.validate("test");
    EXPECT_EQ(q.group, 100);
    const Tensor d = dequantize(q);
    for (int64_t o = 0; o < 7; ++o) {
      const float sc = q.scales.data<float>()[o];
      for (int64_t k = 0; k < 100; ++k) {
        const float x = w.data<float>()[o * 100 + k], y = d.data<float>()[o * 100 + k];
        // fp8 keeps 3 mantissa bits: relative error 1/16, plus the subnormal step.
        const float tol = s == QuantScheme::kFp8 ? std::fabs(x) / 16 + sc * std::ldexp(1.f, -10)
                                                 : sc / 2 + 1e-6f;
        EXPECT_LE(std::fabs(x - y), tol) << quant_scheme_name(s) << " " << o << "," << k;
      }
    }
  }
}

// Every path for one weight against the reference and against dequantize + f32 GEMM.
// 2^-7 sum_k |x_mk| |w_ok| for every output: how far bf16 operands may move a product.
Tensor bf16_gemm_bound(const Tensor& x, const Tensor& w) {
  const int64_t M = x.size(0), K = x.size(1), O = w.size(0);
  Tensor b = Tensor::empty({M, O}, DType::kF32);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t o = 0; o < O; ++o) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k)
        s += std::fabs(x.data<float>()[m * K + k]) * std::fabs(w.data<float>()[o * K + k]);
      b.data<float>()[m * O + o] = static_cast<float>(s / 128.0);
    }
  return b;
}

void check_paths(const QuantWeight& q, int64_t M, uint32_t seed) {
  const Tensor x = random_tensor(M, q.in, seed);
  Tensor ref = Tensor::empty({M, q.out}, DType::kF32);
  reference::quant_matmul(x, q, ref);
  // dequantize-then-GEMM: the float product the quantized one stands for (W8A8 also
  // quantizes x, so it is compared at that precision).
  Tensor dense = Tensor::empty({M, q.out}, DType::kF32);
  Tensor xs = x.clone();
  if (q.smooth.defined())
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < q.in; ++k) xs.data<float>()[m * q.in + k] /= q.smooth.data<float>()[k];
  matmul_with(MatmulBackend::kReference, xs, dequantize(q), dense, false, true, 1.f, 0.f);
  float scale = 0;
  for (int64_t i = 0; i < M * q.out; ++i) scale = std::max(scale, std::fabs(ref.data<float>()[i]));
  const float dense_tol = q.scheme == QuantScheme::kW8A8 ? 0.03f * scale + 0.02f : 1e-4f * (1 + scale);
  // Where this CPU multiplies bf16 natively faster (AMX, or TESSERA_BF16_GEMM=native), the
  // blocked GEMM rounds x and the dequantized rows to bf16: each product is then off by at
  // most 2 x 2^-8 of |x||w|, so the bound is 2^-7 sum |x||w| per output.
  const Tensor abs_bound = bf16_gemm_bound(xs, dequantize(q));
  // The int8 / int4 GEMV that multiplies codes by x quantized per 32-column run (where this
  // ISA level does): its own reference, and against the float product a bound of half an
  // int8 step of the row's largest |x| per weight: max|x_m| / 254 sum_k |w_ok|.
  const bool a8 = cpu::gemv_quantizes_activations(q, cpu::best_quant_isa());
  Tensor ref_a8 = Tensor::empty({M, q.out}, DType::kF32), a8_bound = Tensor::zeros({M, q.out}, DType::kF32);
  if (a8) {
    reference::quant_matmul_a8_runs(x, q, ref_a8);
    const Tensor wd = dequantize(q);
    for (int64_t m = 0; m < M; ++m) {
      float xmax = 0;
      for (int64_t k = 0; k < q.in; ++k) xmax = std::max(xmax, std::fabs(xs.data<float>()[m * q.in + k]));
      for (int64_t o = 0; o < q.out; ++o) {
        double wsum = 0;
        for (int64_t k = 0; k < q.in; ++k) wsum += std::fabs(wd.data<float>()[o * q.in + k]);
        a8_bound.data<float>()[m * q.out + o] = static_cast<float>(xmax / 254.0 * wsum);
      }
    }
  }
  for (QuantPath p : {QuantPath::kGemv, QuantPath::kGemm, QuantPath::kAuto}) {
    Tensor y = Tensor::empty({M, q.out}, DType::kF32);
    y.fill(std::nanf(""));
    quant_matmul_with(p, x, q, y);
    const bool gemm = q.scheme != QuantScheme::kW8A8 &&
                      (p == QuantPath::kGemm || (p == QuantPath::kAuto && M > 8)) &&
                      bf16_native_gemm_faster();
    const bool gemv_a8 = a8 && (p == QuantPath::kGemv || (p == QuantPath::kAuto && M <= 8));
    const Tensor& want = gemv_a8 ? ref_a8 : ref;
    for (int64_t i = 0; i < M * q.out; ++i) {
      const float r = want.data<float>()[i], v = y.data<float>()[i];
      const float bf16_tol = gemm ? abs_bound.data<float>()[i] : gemv_a8 ? a8_bound.data<float>()[i] : 0.f;
      ASSERT_NEAR(v, r, 2e-5f * (1 + scale) + 1e-5f * std::fabs(r) + (gemv_a8 ? 0.f : bf16_tol))
          << quant_scheme_name(q.scheme) << " g" << q.group << " (" << M << "x" << q.in << " @ "
          << q.out << ") path " << static_cast<int>(p) << " at " << i;
      ASSERT_NEAR(v, dense.data<float>()[i], dense_tol + bf16_tol) << quant_scheme_name(q.scheme) << " at " << i;
    }
  }
}

// Every GEMV row kernel this CPU can run (the capped-ISA runs drop the wider ones).
std::vector<cpu::QuantIsa> runnable_isas() {
  std::vector<cpu::QuantIsa> out = {cpu::QuantIsa::kScalar};
  if (cpu_has(IsaLevel::kAvx2)) out.push_back(cpu::QuantIsa::kAvx2);
  if (cpu_has(IsaLevel::kAvx512)) out.push_back(cpu::QuantIsa::kAvx512);
  if (cpu_has(IsaLevel::kAvx512) && base::cpu_features().avx512_vnni) out.push_back(cpu::QuantIsa::kAvx512Vnni);
  return out;
}

TEST(QuantMatmul, EveryPathMatchesTheReferenceOnOddShapes) {
  struct Case {
    QuantScheme s;
    int64_t out, in, group;
  };
  const Case cases[] = {
      {QuantScheme::kInt4, 1, 32, 32},   {QuantScheme::kInt4, 7, 256, 64},
      {QuantScheme::kInt4, 129, 384, 128}, {QuantScheme::kInt4, 33, 128, 32},
      // The integer-dot GEMV's chunks (128 int4 / 64 int8 columns) and runs past them.
      {QuantScheme::kInt4, 9, 160, 32},  {QuantScheme::kInt4, 6, 512, 256},
      {QuantScheme::kInt4, 5, 224, 32},  {QuantScheme::kInt4, 5, 320, 64},
      {QuantScheme::kInt4, 3, 640, 128}, {QuantScheme::kInt8, 11, 192, 64},
      {QuantScheme::kInt8, 5, 2080, 2080}, {QuantScheme::kInt8, 7, 96, 32},
      {QuantScheme::kInt8, 1, 1, 1},     {QuantScheme::kInt8, 7, 100, 100},
      {QuantScheme::kInt8, 129, 96, 32}, {QuantScheme::kInt8, 65, 1029, 1029},
      {QuantScheme::kFp8, 3, 47, 47},    {QuantScheme::kFp8, 129, 256, 256},
      {QuantScheme::kFp8, 17, 256, 64},  {QuantScheme::kW8A8, 1, 33, 33},
      {QuantScheme::kW8A8, 129, 100, 100}, {QuantScheme::kW8A8, 40, 1029, 1029},
  };
  for (cpu::QuantIsa isa : runnable_isas()) {
    SCOPED_TRACE("row kernels " + std::to_string(static_cast<int>(isa)));
    cpu::force_quant_isa_for_testing(isa);
    uint32_t seed = 10;
    for (const Case& c : cases) {
      const QuantWeight q = quantize_rtn(random_tensor(c.out, c.in, seed++), c.s, c.group);
      for (int64_t M : {1, 2, 3, 4, 5, 9, 33}) check_paths(q, M, seed++);
    }
  }
  cpu::force_quant_isa_for_testing(std::nullopt);
  // The default is the best this CPU has.
  EXPECT_EQ(cpu::best_quant_isa(), runnable_isas().back());
}

// The codes at the ends of their range, where the integer kernels' tricks could wrap: int8
// codes 0 and 255 with zero points off 128 (asymmetric, as GPTQ checkpoints store them:
// code - 128 = -128 must not be negated) and W8A8 codes -128 and 127, on every row kernel.
// The per-row s8 quantizer of W8A8 activations, the integer-dot GEMV's x runs and int8 KV
// rows: every vector version gives the reference's bits, ties (x / s exactly k + 1/2, to
// even) and the tails past the last whole vector included.
TEST(QuantizeRowS8, EveryPathGivesTheReferencesBits) {
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (int64_t n : {1, 7, 8, 9, 16, 31, 32, 33, 64, 100, 2048, 2051}) {
    for (int variant = 0; variant < 3; ++variant) {
      std::vector<float> x(n);
      for (float& v : x) v = nd(rng);
      if (variant == 1) {  // amax 127: x / s = x exactly, so halves are ties
        for (float& v : x) v = std::round(v * 40.f) / 2.f;
        x[0] = 127.f;
      }
      if (variant == 2) std::fill(x.begin(), x.end(), 0.f);
      std::vector<int8_t> want(n), got(n);
      const float s = reference::quantize_row_s8(x.data(), n, want.data());
      std::vector<std::pair<const char*, float (*)(const float*, int64_t, int8_t*)>> paths = {
          {"fast", cpu::quantize_row_s8_fast}};
      if (cpu_has(IsaLevel::kAvx2)) paths.push_back({"avx2", cpu::quantize_row_s8_avx2});
      if (cpu_has(IsaLevel::kAvx512)) paths.push_back({"avx512", cpu::quantize_row_s8_avx512});
      for (const auto& [name, fn] : paths) {
        std::fill(got.begin(), got.end(), int8_t{99});
        EXPECT_EQ(fn(x.data(), n, got.data()), s) << name << " n=" << n;
        EXPECT_EQ(got, want) << name << " n=" << n << " variant " << variant;
      }
    }
  }
}

TEST(QuantMatmul, CodesAtTheEndsOfTheirRangeAreExact) {
  std::mt19937 rng(21);
  for (cpu::QuantIsa isa : runnable_isas()) {
    SCOPED_TRACE("row kernels " + std::to_string(static_cast<int>(isa)));
    cpu::force_quant_isa_for_testing(isa);
    for (QuantScheme s : {QuantScheme::kInt8, QuantScheme::kW8A8})
      for (int64_t group : {int64_t{32}, int64_t{256}}) {
        QuantWeight q = quantize_rtn(random_tensor(13, 256, 6), s, s == QuantScheme::kW8A8 ? 0 : group);
        const int64_t n = q.q.numel();
        for (int64_t i = 0; i < n; ++i) {
          const int pick = static_cast<int>(rng() % 3);  // the low end, the high end, random
          if (s == QuantScheme::kW8A8)
            q.q.data<int8_t>()[i] = static_cast<int8_t>(pick == 0 ? -128 : pick == 1 ? 127 : int(rng() % 256) - 128);
          else
            q.q.data<uint8_t>()[i] = static_cast<uint8_t>(pick == 0 ? 0 : pick == 1 ? 255 : rng() % 256);
        }
        if (q.zeros.defined())
          for (int64_t i = 0; i < q.zeros.numel(); ++i) q.zeros.data<float>()[i] = static_cast<float>(rng() % 256);
        q.validate("test");
        for (int64_t M : {1, 3, 4, 6}) check_paths(q, M, 70 + static_cast<uint32_t>(M));
      }
  }
  cpu::force_quant_isa_for_testing(std::nullopt);
}

TEST(QuantMatmul, ActOrderPermutationAndSmoothingAreApplied) {
  std::mt19937 rng(5);
  for (QuantScheme s : {QuantScheme::kInt4, QuantScheme::kInt8, QuantScheme::kW8A8}) {
    QuantWeight q = quantize_rtn(random_tensor(19, 128, 3), s, s == QuantScheme::kW8A8 ? 0 : 32);
    std::vector<int32_t> perm(128);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    q.perm = Tensor::from_vector(perm, {128});
    q.smooth = random_tensor(1, 128, 4, 0.5f, 2.f).view({128});
    q.validate("test");
    // dequantize undoes the permutation: stored column j is column perm[j].
    const Tensor d = dequantize(q);
    q.perm = Tensor();
    const Tensor stored = dequantize(q);
    q.perm = Tensor::from_vector(perm, {128});
    for (int64_t o = 0; o < 19; ++o)
      for (int64_t j = 0; j < 128; ++j)
        ASSERT_EQ(d.data<float>()[o * 128 + perm[j]], stored.data<float>()[o * 128 + j]);
    for (int64_t M : {1, 4, 17}) check_paths(q, M, 40 + static_cast<uint32_t>(M));
  }
}

TEST(QuantMatmul, StridedRowsOfXAndY) {
  const QuantWeight q = quantize_rtn(random_tensor(40, 64, 8), QuantScheme::kInt4, 32);
  const Tensor x = random_tensor(6, 64, 9);
  Tensor wide = Tensor::empty({6, 80}, DType::kF32);
  wide.fill(std::nanf(""));
  Tensor xv = wide.slice(1, 8, 72);
  xv.copy_from(x);
  Tensor ywide = Tensor::empty({6, 50}, DType::kF32);
  Tensor yv = ywide.slice(1, 5, 45);
  Tensor ref = Tensor::empty({6, 40}, DType::kF32), ref_a8 = ref.clone();
  reference::quant_matmul(x, q, ref);
  reference::quant_matmul_a8_runs(x, q, ref_a8);
  const Tensor bound = bf16_gemm_bound(x, dequantize(q));
  for (QuantPath p : {QuantPath::kGemv, QuantPath::kGemm}) {
    quant_matmul_with(p, xv, q, yv);
    const bool bf16 = p == QuantPath::kGemm && bf16_native_gemm_faster();
    const Tensor& want =
        p == QuantPath::kGemv && cpu::gemv_quantizes_activations(q, cpu::best_quant_isa()) ? ref_a8 : ref;
    for (int64_t m = 0; m < 6; ++m)
      for (int64_t o = 0; o < 40; ++o)
        ASSERT_NEAR(ywide.data<float>()[m * 50 + 5 + o], want.data<float>()[m * 40 + o],
                    1e-4f + (bf16 ? bound.data<float>()[m * 40 + o] : 0.f))
            << "path " << static_cast<int>(p) << " at " << m << "," << o;
  }
}

TEST(QuantWeightValidate, NamesWhatIsWrong) {
  auto expect_error = [](const QuantWeight& q, const std::string& needle) {
    try {
      q.validate("layers.0.qkv");
      ADD_FAILURE() << "no error for " << needle;
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("layers.0.qkv"), std::string::npos) << e.what();
    }
  };
  const QuantWeight good = quantize_rtn(random_tensor(4, 64, 1), QuantScheme::kInt4, 32);
  QuantWeight q = good;
  q.zeros = good.zeros.clone();
  q.zeros.data<float>()[0] = std::nanf("");
  expect_error(q, "zero point 0 is nan");
  q = good;
  q.perm = Tensor::from_vector(std::vector<int32_t>(64, 0), {64});
  expect_error(q, "not a permutation");
  q = good;
  q.group = 48;
  expect_error(q, "does not divide");
  q = good;
  q.scales = Tensor::zeros({4, 3}, DType::kF32);
  expect_error(q, "scales are");
  EXPECT_THROW(parse_quant_scheme("int3"), std::exception);
  Tensor y = Tensor::empty({2, 4}, DType::kF32);
  EXPECT_THROW(quant_matmul(random_tensor(2, 63, 1), good, y), std::exception);
}

}  // namespace
}  // namespace tessera::kernels
