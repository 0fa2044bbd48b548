// Scalar reference activations: the textbook formulas (GELU through tanh, as written
// in GPT-2's gelu_new) evaluated in double.
#include "tessera/kernels/reference/activation_ref.h"

#include <algorithm>
#include <cmath>

#include "tessera/kernels/reference/reference_util.h"

namespace tessera::kernels::reference {
namespace {

constexpr double kK = 0.79788456080286535588;  // sqrt(2 / pi)
constexpr double kC = 0.044715;

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// Calls fn(i, n) for every element of an (N, F) tensor.
template <typename Fn>
void each(const Tensor& t, Fn&& fn) {
  for (int64_t n = 0; n < t.size(0); ++n)
    for (int64_t i = 0; i < t.size(1); ++i) fn(n, i);
}

}  // namespace

void swiglu_forward(const Tensor& gate, const Tensor& up, Tensor& out) {
  each(gate, [&](int64_t n, int64_t i) {
    const double g = ref_row<float>(gate, n)[i], u = ref_row<float>(up, n)[i];
    ref_row<float>(out, n)[i] = static_cast<float>(g * sigmoid(g) * u);
  });
}

void swiglu_backward(const Tensor& dout, const Tensor& gate, const Tensor& up, Tensor& dgate,
                     Tensor& dup) {
  each(gate, [&](int64_t n, int64_t i) {
    const double d = ref_row<float>(dout, n)[i];
    const double g = ref_row<float>(gate, n)[i], u = ref_row<float>(up, n)[i];
    const double s = sigmoid(g);
    ref_row<float>(dgate, n)[i] = static_cast<float>(d * u * (s + g * s * (1 - s)));
    ref_row<float>(dup, n)[i] = static_cast<float>(d * g * s);
  });
}

void geglu_forward(const Tensor& gate, const Tensor& up, Tensor& out) {
  each(gate, [&](int64_t n, int64_t i) {
    const double g = ref_row<float>(gate, n)[i], u = ref_row<float>(up, n)[i];
    ref_row<float>(out, n)[i] = static_cast<float>(0.5 * g * (1 + std::tanh(kK * (g + kC * g * g * g))) * u);
  });
}

void geglu_backward(const Tensor& dout, const Tensor& gate, const Tensor& up, Tensor& dgate,
                    Tensor& dup) {
  each(gate, [&](int64_t n, int64_t i) {
    const double d = ref_row<float>(dout, n)[i];
    const double g = ref_row<float>(gate, n)[i], u = ref_row<float>(up, n)[i];
    const double t = std::tanh(kK * (g + kC * g * g * g));
    const double grad = 0.5 * (1 + t) + 0.5 * g * (1 - t * t) * kK * (1 + 3 * kC * g * g);
    ref_row<float>(dgate, n)[i] = static_cast<float>(d * u * grad);
    ref_row<float>(dup, n)[i] = static_cast<float>(d * 0.5 * g * (1 + t));
  });
}

void gelu_forward(const Tensor& x, Tensor& out) {
  each(x, [&](int64_t n, int64_t i) {
    const double v = ref_row<float>(x, n)[i];
    ref_row<float>(out, n)[i] =
        static_cast<float>(0.5 * v * (1 + std::tanh(kK * (v + kC * v * v * v))));
  });
}

void gelu_backward(const Tensor& dout, const Tensor& x, Tensor& dx) {
  each(x, [&](int64_t n, int64_t i) {
    const double v = ref_row<float>(x, n)[i];
    const double t = std::tanh(kK * (v + kC * v * v * v));
    const double grad = 0.5 * (1 + t) + 0.5 * v * (1 - t * t) * kK * (1 + 3 * kC * v * v);
    ref_row<float>(dx, n)[i] = static_cast<float>(ref_row<float>(dout, n)[i] * grad);
  });
}

void softmax_forward(const Tensor& x, Tensor& out) {
  const int64_t F = x.size(1);
  for (int64_t n = 0; n < x.size(0); ++n) {
    const float* xr = ref_row<float>(x, n);
    float* o = ref_row<float>(out, n);
    const double mx = *std::max_element(xr, xr + F);
    double sum = 0;
    for (int64_t i = 0; i < F; ++i) sum += std::exp(xr[i] - mx);
    for (int64_t i = 0; i < F; ++i) o[i] = static_cast<float>(std::exp(xr[i] - mx) / sum);
  }
}

void softmax_backward(const Tensor& dout, const Tensor& out, Tensor& dx) {
  const int64_t F = out.size(1);
  for (int64_t n = 0; n < out.size(0); ++n) {
    const float* dy = ref_row<float>(dout, n);
    const float* y = ref_row<float>(out, n);
    double dot = 0;
    for (int64_t i = 0; i < F; ++i) dot += static_cast<double>(dy[i]) * y[i];
    float* d = ref_row<float>(dx, n);
    for (int64_t i = 0; i < F; ++i) d[i] = static_cast<float>(y[i] * (dy[i] - dot));
  }
}

}  // namespace tessera::kernels::reference
