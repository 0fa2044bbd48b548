// Helpers shared by the pointwise kernel tests: random (optionally strided) inputs,
// closeness checks with a readable first mismatch, and switching the kernels' ISA.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <initializer_list>
#include <random>
#include <string>
#include <vector>

#include "test_util/throws.h"
#include "tessera/base/cpu_features.h"
#include "tessera/kernels/cpu/pointwise_common.h"
#include "tessera/tensor/tensor.h"

namespace tessera::kernels::test_util {

// An (n, f) f32 matrix; strided = a column slice [3, 3 + f) of an (n, f + 5) buffer, so
// rows are strided and misaligned. `buf` is the whole buffer (to check the padding).
struct Mat {
  Tensor buf;
  Tensor view;
};

inline void fill_uniform(Tensor& t, std::mt19937& rng, float lo, float hi) {
  std::uniform_real_distribution<float> u(lo, hi);
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = u(rng);
}

inline Mat random_mat(int64_t n, int64_t f, std::mt19937& rng, bool strided, float lo = -2.f,
                      float hi = 2.f) {
  Mat m;
  m.buf = Tensor::empty({n, strided ? f + 5 : f}, DType::kF32);
  fill_uniform(m.buf, rng, lo, hi);
  m.view = strided ? m.buf.slice(1, 3, 3 + f) : m.buf;
  return m;
}

// A (n) tensor of dtype dt with values uniform in [lo, hi) (rounded when dt is bf16).
inline Tensor random_vec(int64_t n, std::mt19937& rng, DType dt, float lo, float hi) {
  Tensor t = Tensor::empty({n}, DType::kF32);
  fill_uniform(t, rng, lo, hi);
  return t.to(dt);
}

inline std::vector<float> values(const Tensor& t) { return t.contiguous().to_f32_vector(); }

// |got - want| <= atol + rtol * |want| elementwise (NaN only matches NaN).
inline ::testing::AssertionResult all_close(const Tensor& got, const Tensor& want, double rtol,
                                            double atol) {
  if (got.shape() != want.shape())
    return ::testing::AssertionFailure()
           << "shape " << shape_str(got.shape()) << " vs " << shape_str(want.shape());
  const auto g = values(got), w = values(want);
  int64_t bad = 0, first = -1;
  double worst = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    const bool nan_ok = std::isnan(g[i]) && std::isnan(w[i]);
    const double err = std::fabs(static_cast<double>(g[i]) - w[i]);
    if (nan_ok) continue;
    if (!(err <= atol + rtol * std::fabs(w[i]))) {
      if (first < 0) first = static_cast<int64_t>(i);
      ++bad;
    }
    if (err > worst) worst = err;
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << bad << " of " << g.size() << " elements differ; first at flat index " << first
         << ": got " << g[first] << ", want " << w[first] << "; max abs error " << worst;
}

inline ::testing::AssertionResult bitwise_equal(const Tensor& a, const Tensor& b) {
  const auto x = values(a), y = values(b);
  if (x.size() != y.size()) return ::testing::AssertionFailure() << "sizes differ";
  for (size_t i = 0; i < x.size(); ++i)
    if (std::memcmp(&x[i], &y[i], sizeof(float)) != 0)
      return ::testing::AssertionFailure()
             << "index " << i << ": " << x[i] << " vs " << y[i];
  return ::testing::AssertionSuccess();
}

// The ISAs this machine can run: always the portable path, AVX-512 where present.
inline std::vector<cpu::Isa> isas_to_test() {
  std::vector<cpu::Isa> v{cpu::Isa::kScalar};
  const auto& f = base::cpu_features();
  if (f.avx512f && f.avx512bw && f.avx512vl) v.push_back(cpu::Isa::kAvx512);
  return v;
}

inline const char* isa_name(cpu::Isa isa) {
  return isa == cpu::Isa::kAvx512 ? "avx512" : "scalar";
}

// Forces an ISA for the kernels while in scope; restores auto detection after.
struct ScopedIsa {
  explicit ScopedIsa(cpu::Isa isa) { cpu::set_pointwise_isa_for_testing(isa); }
  ~ScopedIsa() { cpu::set_pointwise_isa_for_testing(cpu::Isa::kAvx512); }
};

// The odd shapes every pointwise kernel is checked on.
inline const std::vector<int64_t>& test_rows() {
  static const std::vector<int64_t> v{1, 7, 129};
  return v;
}
inline const std::vector<int64_t>& test_cols() {
  static const std::vector<int64_t> v{1, 7, 64, 129, 768};
  return v;
}

using tessera::testing::throws_error;  // (test_util/throws.h)

}  // namespace tessera::kernels::test_util
