// AWQ's scale and clip searches and SmoothQuant's smoothing factors (awq.h). Every
// candidate is scored on the Gram matrix of the calibration inputs, so the cost does not
// grow with the number of calibration tokens: one (out, in) x (in, in) GEMM per scale
// candidate, a group-sized quadratic form per clip candidate.
#include "tessera/kernels/awq.h"

#include <algorithm>
#include <cmath>

#include "tessera/base/error.h"
#include "tessera/base/thread_pool.h"
#include "tessera/kernels/matmul.h"
#include "tessera/kernels/quant_params.h"

namespace tessera::kernels {
namespace {

void check_weight(const Tensor& w, const char* what) {
  TESSERA_CHECK(w.dim() == 2 && w.dtype() == DType::kF32 && w.is_contiguous(), what,
                ": weight must be a contiguous (out, in) f32 tensor, got ", w.describe());
}

int64_t group_of(const AwqOptions& o, int64_t in) {
  const int64_t g = o.group <= 0 ? in : o.group;
  TESSERA_CHECK(in % g == 0, "awq: group size ", g, " does not divide the ", in, " input features");
  return g;
}

// ||D X^T||^2 = sum(D * (D G)) for D (out, in) f32.
double output_error(const Tensor& d, const Tensor& gram) {
  Tensor dg = Tensor::empty(d.shape(), DType::kF32);
  matmul(d, gram, dg);
  const float* a = d.data<float>();
  const float* b = dg.data<float>();
  double e = 0;
  for (int64_t i = 0; i < d.numel(); ++i) e += static_cast<double>(a[i]) * b[i];
  return e;
}

}  // namespace

InputStats input_stats(const Tensor& x_in, bool with_gram) {
  TESSERA_CHECK(x_in.dim() == 2 && x_in.size(0) > 0, "awq: calibration inputs must be (N, in), got ",
                x_in.describe());
  const Tensor x = x_in.to(DType::kF32).contiguous();
  const int64_t n = x.size(0), in = x.size(1);
  InputStats s;
  s.mean_abs.assign(in, 0.f);
  s.max_abs.assign(in, 0.f);
  std::vector<double> sum(in, 0.0);
  const float* X = x.data<float>();
  for (int64_t r = 0; r < n; ++r)
    for (int64_t j = 0; j < in; ++j) {
      const float a = std::fabs(X[r * in + j]);
      sum[j] += a;
      s.max_abs[j] = std::max(s.max_abs[j], a);
    }
  for (int64_t j = 0; j < in; ++j) s.mean_abs[j] = static_cast<float>(sum[j] / n);
  if (!with_gram) return s;
  s.gram = Tensor::empty({in, in}, DType::kF32);
  matmul(x, x, s.gram, true, false);
  return s;
}

Tensor scale_columns(const Tensor& w_in, const std::vector<float>& s) {
  Tensor w = w_in.to(DType::kF32).contiguous().clone();
  const int64_t out = w.size(0), in = w.size(1);
  TESSERA_CHECK(static_cast<int64_t>(s.size()) == in, "scale_columns: ", s.size(),
                " scales for ", in, " columns");
  float* W = w.data<float>();
  for (int64_t o = 0; o < out; ++o)
    for (int64_t j = 0; j < in; ++j) W[o * in + j] *= s[j];
  return w;
}

Tensor unscale_gram(const Tensor& gram, const std::vector<float>& s) {
  Tensor g = gram.clone();
  const int64_t in = g.size(0);
  float* G = g.data<float>();
  for (int64_t j = 0; j < in; ++j)
    for (int64_t k = 0; k < in; ++k) G[j * in + k] /= s[j] * s[k];
  return g;
}

namespace {

// The candidates awq_search_scales scores, in order: s = 1 first, then ratio 0 .. (grid - 1) / grid.
std::vector<std::vector<float>> awq_scale_candidates(const Tensor& w, const InputStats& x,
                                                     const AwqOptions& o) {
  check_weight(w, "awq");
  const int64_t out = w.size(0), in = w.size(1), group = group_of(o, in);
  TESSERA_CHECK(static_cast<int64_t>(x.mean_abs.size()) == in, "awq: input statistics have ",
                x.mean_abs.size(), " channels, the weight ", in);
  TESSERA_CHECK(o.grid >= 1, "awq: grid must be positive, got ", o.grid);
  // w_mean: each weight relative to its group's max |w|, averaged over the output rows.
  std::vector<double> wsum(in, 0.0);
  const float* W = w.data<float>();
  for (int64_t r = 0; r < out; ++r)
    for (int64_t g0 = 0; g0 < in; g0 += group) {
      float m = 0.f;
      for (int64_t j = g0; j < g0 + group; ++j) m = std::max(m, std::fabs(W[r * in + j]));
      for (int64_t j = g0; j < g0 + group; ++j) wsum[j] += std::fabs(W[r * in + j]) / (m + 1e-6f);
    }
  std::vector<float> w_mean(in);
  for (int64_t j = 0; j < in; ++j) w_mean[j] = static_cast<float>(wsum[j] / out);
  std::vector<std::vector<float>> cands{std::vector<float>(in, 1.f)};
  for (int i = 0; i < o.grid; ++i) {
    const double ratio = static_cast<double>(i) / o.grid;
    std::vector<float> s(in);
    float lo = INFINITY, hi = 0.f;
    for (int64_t j = 0; j < in; ++j) {
      double v = std::pow(static_cast<double>(x.mean_abs[j]), ratio) /
                 (std::pow(static_cast<double>(w_mean[j]), 1.0 - ratio) + 1e-4);
      if (!std::isfinite(v)) v = 1.0;
      s[j] = static_cast<float>(std::max(v, 1e-4));
      lo = std::min(lo, s[j]), hi = std::max(hi, s[j]);
    }
    const float norm = std::sqrt(lo * hi);
    for (auto& v : s) v /= norm;
    cands.push_back(std::move(s));
  }
  return cands;
}

// What the quantized W diag(s) computes in W's frame: dequantize(Q(W diag s)) diag(1 / s).
Tensor awq_fake_quantize(const Tensor& w, const std::vector<float>& s, QuantScheme scheme,
                         const AwqOptions& o) {
  const int64_t out = w.size(0), in = w.size(1);
  Tensor d = dequantize(quantize_rtn(scale_columns(w, s), scheme, group_of(o, in), o.symmetric, o.f16_scales));
  float* D = d.data<float>();
  for (int64_t r = 0; r < out; ++r)
    for (int64_t j = 0; j < in; ++j) D[r * in + j] /= s[j];
  return d;
}

}  // namespace

std::vector<float> awq_search_scales(const Tensor& w, const InputStats& x, QuantScheme scheme,
                                     const AwqOptions& o, const AwqError& error) {
  check_weight(w, "awq");
  const auto cands = awq_scale_candidates(w, x, o);
  size_t best = 0;
  double best_err = INFINITY;
  for (size_t i = 0; i < cands.size(); ++i) {
    const double err = error(awq_fake_quantize(w, cands[i], scheme, o));
    if (err < best_err) best_err = err, best = i;
  }
  return cands[best];
}

std::vector<float> awq_search_scales(const Tensor& w, const InputStats& x, QuantScheme scheme,
                                     const AwqOptions& o) {
  check_weight(w, "awq");
  TESSERA_CHECK(x.gram.defined() && x.gram.size(0) == w.size(1), "awq: input statistics have no ",
                w.size(1), "-channel Gram matrix");
  // The error of quantizing W diag(s), measured back in W's frame, on the linear's output.
  const float* W = w.data<float>();
  return awq_search_scales(w, x, scheme, o, [&](Tensor d) {
    float* D = d.data<float>();
    for (int64_t i = 0; i < d.numel(); ++i) D[i] -= W[i];
    return output_error(d, x.gram);
  });
}

void awq_clip(Tensor& w, const Tensor& gram, int64_t row0, int64_t row1, QuantScheme scheme,
              const AwqOptions& o) {
  check_weight(w, "awq clip");
  TESSERA_CHECK(scheme == QuantScheme::kInt8 || scheme == QuantScheme::kInt4,
                "awq: clipping is for int8 / int4 weights, not ", quant_scheme_name(scheme));
  const int64_t in = w.size(1), group = group_of(o, in);
  TESSERA_CHECK(0 <= row0 && row0 <= row1 && row1 <= w.size(0), "awq clip: rows [", row0, ", ",
                row1, ") out of ", w.size(0));
  TESSERA_CHECK(gram.dim() == 2 && gram.size(0) == in && gram.size(1) == in,
                "awq clip: gram must be (", in, ", ", in, "), got ", gram.describe());
  const int bits = quant_bits(scheme);
  const int steps = static_cast<int>(o.max_shrink * o.grid);
  const float* G = gram.data<float>();
  float* W = w.data<float>();
  base::parallel_for(row1 - row0, 8, [&](int64_t r0, int64_t r1) {
    std::vector<float> clipped(group);
    std::vector<double> d(group);
    for (int64_t r = row0 + r0; r < row0 + r1; ++r)
      for (int64_t g0 = 0; g0 < in; g0 += group) {
        float* wg = W + r * in + g0;
        float org_max = 0.f;
        for (int64_t j = 0; j < group; ++j) org_max = std::max(org_max, std::fabs(wg[j]));
        if (org_max == 0.f) continue;
        double best_err = INFINITY;
        float best_max = org_max;
        for (int i = 0; i < std::max(steps, 1); ++i) {
          const float mx = org_max * (1.f - static_cast<float>(i) / o.grid);
          for (int64_t j = 0; j < group; ++j) clipped[j] = std::clamp(wg[j], -mx, mx);
          float s, z;
          int_params(clipped.data(), group, bits, o.symmetric, o.f16_scales, s, z);
          for (int64_t j = 0; j < group; ++j)
            d[j] = s * (quantize_value(clipped[j], s, z, bits) - z) - wg[j];
          double err = 0;
          for (int64_t j = 0; j < group; ++j) {
            const float* gj = G + (g0 + j) * in + g0;
            double t = 0;
            for (int64_t k = 0; k < group; ++k) t += gj[k] * d[k];
            err += d[j] * t;
          }
          if (err < best_err) best_err = err, best_max = mx;
        }
        for (int64_t j = 0; j < group; ++j) wg[j] = std::clamp(wg[j], -best_max, best_max);
      }
  });
}

std::vector<float> smoothquant_scales(const Tensor& w, const std::vector<float>& act_absmax,
                                      double alpha) {
  check_weight(w, "smoothquant");
  const int64_t out = w.size(0), in = w.size(1);
  TESSERA_CHECK(static_cast<int64_t>(act_absmax.size()) == in, "smoothquant: ", act_absmax.size(),
                " activation maxima for ", in, " input features");
  TESSERA_CHECK(alpha >= 0 && alpha <= 1, "smoothquant: --alpha ", alpha, " is not in [0, 1]");
  std::vector<float> wmax(in, 0.f);
  const float* W = w.data<float>();
  for (int64_t r = 0; r < out; ++r)
    for (int64_t j = 0; j < in; ++j) wmax[j] = std::max(wmax[j], std::fabs(W[r * in + j]));
  std::vector<float> s(in);
  for (int64_t j = 0; j < in; ++j) {
    const double a = act_absmax[j], b = std::max(wmax[j], 1e-5f);
    s[j] = static_cast<float>(std::max(std::pow(a, alpha) / std::pow(b, 1.0 - alpha), 1e-5));
  }
  return s;
}

}  // namespace tessera::kernels
