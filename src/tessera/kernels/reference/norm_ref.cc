// Scalar reference RMSNorm / LayerNorm: straight formulas in double, one row at a time.
#include "tessera/kernels/reference/norm_ref.h"

#include <cmath>
#include <vector>

#include "tessera/kernels/reference/reference_util.h"

namespace tessera::kernels::reference {

void rmsnorm_forward(const Tensor& x, const Tensor& weight, float eps, Tensor& out,
                     Tensor* rstd) {
  const int64_t N = x.size(0), H = x.size(1);
  for (int64_t n = 0; n < N; ++n) {
    const float* xr = ref_row<float>(x, n);
    float* o = ref_row<float>(out, n);
    double ss = 0;
    for (int64_t i = 0; i < H; ++i) ss += static_cast<double>(xr[i]) * xr[i];
    const double r = 1.0 / std::sqrt(ss / H + eps);
    for (int64_t i = 0; i < H; ++i) o[i] = static_cast<float>(xr[i] * r * ref_param(weight, i));
    if (rstd) rstd->data<float>()[n] = static_cast<float>(r);
  }
}

void rmsnorm_backward(const Tensor& dout, const Tensor& x, const Tensor& weight,
                      const Tensor& rstd, Tensor& dx, Tensor& dweight) {
  const int64_t N = x.size(0), H = x.size(1);
  std::vector<double> dw(H, 0.0);  // summed over rows in double, added once
  for (int64_t n = 0; n < N; ++n) {
    const float* g = ref_row<float>(dout, n);
    const float* xr = ref_row<float>(x, n);
    float* d = ref_row<float>(dx, n);
    const double r = rstd.data<float>()[n];
    // y_i = w_i x_i r, r = (mean(x^2) + eps)^-1/2, dr/dx_j = -r^3 x_j / H.
    double dot = 0;
    for (int64_t i = 0; i < H; ++i) dot += ref_param(weight, i) * g[i] * xr[i];
    for (int64_t i = 0; i < H; ++i) {
      d[i] = static_cast<float>(r * ref_param(weight, i) * g[i] - r * r * r * xr[i] * dot / H);
      dw[i] += static_cast<double>(g[i]) * xr[i] * r;
    }
  }
  for (int64_t i = 0; i < H; ++i) dweight.data<float>()[i] += static_cast<float>(dw[i]);
}

void layernorm_forward(const Tensor& x, const Tensor& weight, const Tensor& bias, float eps,
                       Tensor& out, Tensor* mean, Tensor* rstd) {
  const int64_t N = x.size(0), H = x.size(1);
  for (int64_t n = 0; n < N; ++n) {
    const float* xr = ref_row<float>(x, n);
    float* o = ref_row<float>(out, n);
    double s = 0;
    for (int64_t i = 0; i < H; ++i) s += xr[i];
    const double mu = s / H;
    double v = 0;
    for (int64_t i = 0; i < H; ++i) v += (xr[i] - mu) * (xr[i] - mu);
    const double r = 1.0 / std::sqrt(v / H + eps);
    for (int64_t i = 0; i < H; ++i)
      o[i] = static_cast<float>((xr[i] - mu) * r * ref_param(weight, i) + ref_param(bias, i));
    if (mean) mean->data<float>()[n] = static_cast<float>(mu);
    if (rstd) rstd->data<float>()[n] = static_cast<float>(r);
  }
}

void layernorm_backward(const Tensor& dout, const Tensor& x, const Tensor& weight,
                        const Tensor& mean, const Tensor& rstd, Tensor& dx, Tensor& dweight,
                        Tensor& dbias) {
  const int64_t N = x.size(0), H = x.size(1);
  std::vector<double> dw(H, 0.0), db(H, 0.0);
  for (int64_t n = 0; n < N; ++n) {
    const float* g = ref_row<float>(dout, n);
    const float* xr = ref_row<float>(x, n);
    float* d = ref_row<float>(dx, n);
    const double mu = mean.data<float>()[n], r = rstd.data<float>()[n];
    double sum_g = 0, sum_gn = 0;  // sums of dL/dnorm and dL/dnorm * norm
    for (int64_t i = 0; i < H; ++i) {
      const double gn = ref_param(weight, i) * g[i];
      sum_g += gn;
      sum_gn += gn * (xr[i] - mu) * r;
    }
    for (int64_t i = 0; i < H; ++i) {
      const double norm = (xr[i] - mu) * r;
      const double gn = ref_param(weight, i) * g[i];
      d[i] = static_cast<float>(r * (gn - sum_g / H - norm * sum_gn / H));
      dw[i] += norm * g[i];
      db[i] += g[i];
    }
  }
  for (int64_t i = 0; i < H; ++i) {
    dweight.data<float>()[i] += static_cast<float>(dw[i]);
    dbias.data<float>()[i] += static_cast<float>(db[i]);
  }
}

namespace {
void add_rows(Tensor& residual, const Tensor& delta) {
  for (int64_t n = 0; n < residual.size(0); ++n) {
    float* r = ref_row<float>(residual, n);
    const float* d = ref_row<float>(delta, n);
    for (int64_t i = 0; i < residual.size(1); ++i) r[i] += d[i];
  }
}
}  // namespace

void add_rmsnorm_forward(Tensor& residual, const Tensor& delta, const Tensor& weight, float eps,
                         Tensor& out, Tensor* rstd) {
  add_rows(residual, delta);
  rmsnorm_forward(residual, weight, eps, out, rstd);
}

void add_layernorm_forward(Tensor& residual, const Tensor& delta, const Tensor& weight,
                           const Tensor& bias, float eps, Tensor& out, Tensor* mean,
                           Tensor* rstd) {
  add_rows(residual, delta);
  layernorm_forward(residual, weight, bias, eps, out, mean, rstd);
}

}  // namespace tessera::kernels::reference
