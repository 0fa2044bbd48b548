// Triple-loop matmul with double accumulation; slow on purpose, obviously right.
#include "tessera/kernels/reference/matmul_ref.h"

#include <vector>

namespace tessera::kernels::reference {
namespace {

// Element (i, j) of a 2-D f32/bf16 tensor, optionally rounded through bf16.
float element(const Tensor& t, int64_t i, int64_t j, bool round_bf16) {
  const int64_t off = i * t.stride(0) + j * t.stride(1);
  float v = t.dtype() == DType::kBF16 ? bf16_to_f32(static_cast<const uint16_t*>(t.raw_data())[off])
                                      : static_cast<const float*>(t.raw_data())[off];
  return round_bf16 ? bf16_to_f32(f32_to_bf16(v)) : v;
}

}  // namespace

void matmul(const Tensor& a, const Tensor& b, Tensor& c, bool trans_a, bool trans_b,
            float alpha, float beta) {
  TESSERA_CHECK(a.dim() == 2 && b.dim() == 2 && c.dim() == 2,
                "reference::matmul: a, b, c must be 2-D");
  c.check_dtype(DType::kF32);
  const int64_t m = trans_a ? a.size(1) : a.size(0);
  const int64_t k = trans_a ? a.size(0) : a.size(1);
  const int64_t n = trans_b ? b.size(0) : b.size(1);
  TESSERA_CHECK((trans_b ? b.size(1) : b.size(0)) == k && c.size(0) == m && c.size(1) == n,
                "reference::matmul: shapes do not match: a ", a.describe(), " b ", b.describe(),
                " c ", c.describe());
  const bool mixed = a.dtype() != b.dtype();
  const bool round_a = mixed && a.dtype() == DType::kF32;
  const bool round_b = mixed && b.dtype() == DType::kF32;
  // op(a) as (M, K) and op(b) as (N, K) in double, so the triple loop is plain arithmetic.
  std::vector<double> ad(m * k), bd(n * k);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t t = 0; t < k; ++t)
      ad[i * k + t] = trans_a ? element(a, t, i, round_a) : element(a, i, t, round_a);
  for (int64_t j = 0; j < n; ++j)
    for (int64_t t = 0; t < k; ++t)
      bd[j * k + t] = trans_b ? element(b, j, t, round_b) : element(b, t, j, round_b);
  float* cd = static_cast<float*>(c.raw_data());
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double acc = 0;
      for (int64_t t = 0; t < k; ++t) acc += ad[i * k + t] * bd[j * k + t];
      float& out = cd[i * c.stride(0) + j * c.stride(1)];
      const double prev = beta == 0.f ? 0.0 : static_cast<double>(beta) * out;
      out = static_cast<float>(static_cast<double>(alpha) * acc + prev);
    }
}

}  // namespace tessera::kernels::reference
