// GPTQ (gptq.h), in f64 throughout the error compensation; codes and group parameters
// come from the same quantizer as round-to-nearest (quant_params.h).
#include "tessera/kernels/gptq.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "tessera/base/error.h"
#include "tessera/base/thread_pool.h"
#include "tessera/kernels/quant_params.h"

namespace tessera::kernels {
namespace {

// In-place lower Cholesky factor of the n x n row-major a (the upper triangle is left
// as it was); false when a is not positive definite.
bool cholesky_lower(std::vector<double>& a, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    double d = a[j * n + j];
    for (int64_t k = 0; k < j; ++k) d -= a[j * n + k] * a[j * n + k];
    if (!(d > 0)) return false;
    const double l = std::sqrt(d);
    a[j * n + j] = l;
    base::parallel_for(n - j - 1, 64, [&](int64_t i0, int64_t i1) {
      for (int64_t i = j + 1 + i0; i < j + 1 + i1; ++i) {
        double s = a[i * n + j];
        for (int64_t k = 0; k < j; ++k) s -= a[i * n + k] * a[j * n + k];
        a[i * n + j] = s / l;
      }
    });
  }
  return true;
}

// The upper Cholesky factor U of H^-1 (H^-1 = U^T U), from H's lower factor L:
// H^-1 = L^-T L^-1, then its own Cholesky factor, transposed (torch: cholesky,
// cholesky_inverse, cholesky(upper=True)).
std::vector<double> inverse_upper_cholesky(std::vector<double> h, int64_t n) {
  TESSERA_CHECK(cholesky_lower(h, n), "gptq: the damped Hessian is not positive definite "
                "(raise percdamp or give more calibration rows)");
  // Linv = L^-1 (lower), held transposed (linv_t[c][i] = Linv[i][c]) so that every inner
  // loop below reads rows: column c of Linv by forward substitution.
  std::vector<double> linv_t(n * n, 0.0);
  base::parallel_for(n, 8, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      double* col = linv_t.data() + c * n;
      col[c] = 1.0 / h[c * n + c];
      for (int64_t i = c + 1; i < n; ++i) {
        const double* li = h.data() + i * n;
        double s = 0;
        for (int64_t k = c; k < i; ++k) s -= li[k] * col[k];
        col[i] = s / li[i];
      }
    }
  });
  // Hinv = Linv^T Linv: Hinv[i][j] = sum over k >= max(i, j) of Linv[k][i] Linv[k][j].
  std::vector<double> hinv(n * n);
  base::parallel_for(n, 8, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i)
      for (int64_t j = 0; j <= i; ++j) {
        const double *a = linv_t.data() + i * n, *b = linv_t.data() + j * n;
        double s = 0;
        for (int64_t k = i; k < n; ++k) s += a[k] * b[k];
        hinv[i * n + j] = hinv[j * n + i] = s;
      }
  });
  TESSERA_CHECK(cholesky_lower(hinv, n), "gptq: the inverse Hessian is not positive definite");
  std::vector<double> u(n * n, 0.0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j <= i; ++j) u[j * n + i] = hinv[i * n + j];
  return u;
}

}  // namespace

QuantWeight quantize_gptq(const Tensor& w_in, const std::vector<double>& hessian, QuantScheme scheme,
                          const GptqOptions& o) {
  TESSERA_CHECK(scheme == QuantScheme::kInt8 || scheme == QuantScheme::kInt4,
                "gptq: scheme ", quant_scheme_name(scheme), " is not int8 or int4");
  TESSERA_CHECK(w_in.dim() == 2, "gptq: weight must be 2-D, got ", w_in.describe());
  const int64_t out = w_in.size(0), in = w_in.size(1);
  TESSERA_CHECK(static_cast<int64_t>(hessian.size()) == in * in, "gptq: the Hessian has ",
                hessian.size(), " values, not ", in, " x ", in);
  TESSERA_CHECK(o.percdamp > 0 && o.percdamp < 1, "gptq: percdamp ", o.percdamp, " must be in (0, 1)");
  TESSERA_CHECK(o.block > 0, "gptq: block ", o.block, " must be positive");
  const int64_t group = o.group <= 0 ? in : o.group;
  TESSERA_CHECK(in % group == 0, "gptq: group size ", group, " does not divide the ", in, " input features");
  TESSERA_CHECK(scheme != QuantScheme::kInt4 || group % 32 == 0, "gptq: int4 group size ", group,
                " is not a multiple of 32");
  const int bits = quant_bits(scheme);
  const Tensor wf = w_in.to(DType::kF32).contiguous();
  std::vector<double> W(wf.data<float>(), wf.data<float>() + out * in);
  std::vector<double> H = hessian;
  for (double v : H) TESSERA_CHECK(std::isfinite(v), "gptq: the Hessian has a non-finite value");
  // Dead inputs: never seen in calibration, so nothing to preserve there.
  for (int64_t j = 0; j < in; ++j)
    if (H[j * in + j] == 0) {
      H[j * in + j] = 1;
      for (int64_t r = 0; r < out; ++r) W[r * in + j] = 0;
    }
  std::vector<int32_t> perm(in);
  std::iota(perm.begin(), perm.end(), 0);
  if (o.act_order) {
    std::stable_sort(perm.begin(), perm.end(),
                     [&](int32_t a, int32_t b) { return H[a * in + a] > H[b * in + b]; });
    std::vector<double> w2(W.size()), h2(H.size());
    for (int64_t r = 0; r < out; ++r)
      for (int64_t j = 0; j < in; ++j) w2[r * in + j] = W[r * in + perm[j]];
    for (int64_t i = 0; i < in; ++i)
      for (int64_t j = 0; j < in; ++j) h2[i * in + j] = H[perm[i] * in + perm[j]];
    W.swap(w2);
    H.swap(h2);
  }
  double mean_diag = 0;
  for (int64_t j = 0; j < in; ++j) mean_diag += H[j * in + j];
  const double damp = o.percdamp * mean_diag / static_cast<double>(in);
  for (int64_t j = 0; j < in; ++j) H[j * in + j] += damp;
  const std::vector<double> U = inverse_upper_cholesky(std::move(H), in);

  QuantWeight r;
  r.scheme = scheme;
  r.out = out, r.in = in, r.group = group;
  const int64_t G = in / group;
  r.scales = Tensor::empty({out, G}, DType::kF32);
  r.zeros = Tensor::empty({out, G}, DType::kF32);
  std::vector<int32_t> codes(out * in);
  float* S = r.scales.data<float>();
  float* Z = r.zeros.data<float>();
  const float maxq = static_cast<float>((1 << bits) - 1);
  for (int64_t i1 = 0; i1 < in; i1 += o.block) {
    const int64_t i2 = std::min(in, i1 + o.block), count = i2 - i1;
    // Rows are independent: each row's columns are quantized in order.
    base::parallel_for(out, 16, [&](int64_t r0, int64_t r1) {
      std::vector<float> grp(group);
      std::vector<double> err(count);  // this row's scaled errors over the block
      for (int64_t row = r0; row < r1; ++row) {
        double* w = W.data() + row * in;
        // The block's columns, updated within the block as each is quantized (W1).
        std::vector<double> w1(w + i1, w + i2);
        for (int64_t i = 0; i < count; ++i) {
          const int64_t c = i1 + i, g = c / group;
          if (c % group == 0) {  // group parameters from the current weights (W, not W1)
            for (int64_t k = 0; k < group; ++k) grp[k] = static_cast<float>(w[c + k]);
            int_params(grp.data(), group, bits, o.symmetric, o.f16_scales, S[row * G + g], Z[row * G + g]);
          }
          const float s = S[row * G + g], z = Z[row * G + g];
          const double x = w1[i];
          const double qc = std::clamp(std::nearbyint(x / static_cast<double>(s)) + z, 0.0,
                                       static_cast<double>(maxq));
          codes[row * in + c] = static_cast<int32_t>(qc);
          const double q = static_cast<double>(s) * (qc - z);
          const double e = (x - q) / U[c * in + c];
          for (int64_t k = i; k < count; ++k) w1[k] -= e * U[c * in + i1 + k];
          err[i] = e;
        }
        // The columns after the block take the block's errors (lazy batch update), read
        // along the rows of U.
        for (int64_t i = 0; i < count; ++i) {
          const double e = err[i];
          const double* u = U.data() + (i1 + i) * in;
          for (int64_t k = i2; k < in; ++k) w[k] -= e * u[k];
        }
      }
    });
  }
  r.q = Tensor::empty(scheme == QuantScheme::kInt4 ? Shape{out, in / 2} : Shape{out, in}, DType::kU8);
  for (int64_t row = 0; row < out; ++row) {
    if (scheme == QuantScheme::kInt4)
      pack_int4(codes.data() + row * in, in, r.q.data<uint8_t>() + row * (in / 2));
    else
      for (int64_t j = 0; j < in; ++j) r.q.data<uint8_t>()[row * in + j] = static_cast<uint8_t>(codes[row * in + j]);
  }
  if (o.act_order) r.perm = Tensor::from_vector(perm, {in});
  r.validate("gptq");
  return r;
}

}  // namespace tessera::kernels
