// Scalar quantized products: the independent reference the CPU kernels are tested against.
#include "tessera/kernels/reference/quant_ref.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace tessera::kernels::reference {
namespace {

// The integer (or e4m3 code) stored for weight (o, j), j a stored column.
int32_t stored_code(const QuantWeight& w, int64_t o, int64_t j) {
  if (w.scheme == QuantScheme::kInt4) {
    const uint8_t byte = w.q.data<uint8_t>()[o * (w.in / 2) + (j / 32) * 16 + (j % 32) % 16];
    return (j % 32) < 16 ? (byte & 0xF) : (byte >> 4);
  }
  if (w.scheme == QuantScheme::kW8A8) return w.q.data<int8_t>()[o * w.in + j];
  return w.q.data<uint8_t>()[o * w.in + j];
}

float stored_value(const QuantWeight& w, int64_t o, int64_t j) {
  const int64_t g = j / w.group, G = w.in / w.group;
  const float s = w.scales.data<float>()[o * G + g];
  const int32_t c = stored_code(w, o, j);
  switch (w.scheme) {
    case QuantScheme::kInt8:
    case QuantScheme::kInt4: return s * (static_cast<float>(c) - w.zeros.data<float>()[o * G + g]);
    case QuantScheme::kFp8: return s * fp8_e4m3_to_f32(static_cast<uint8_t>(c));
    case QuantScheme::kW8A8: return s * static_cast<float>(c);
  }
  return 0.f;
}

int64_t column_of(const QuantWeight& w, int64_t j) {
  return w.perm.defined() ? w.perm.data<int32_t>()[j] : j;
}

}  // namespace

Tensor dequantize(const QuantWeight& w) {
  Tensor out = Tensor::empty({w.out, w.in}, DType::kF32);
  float* d = out.data<float>();
  for (int64_t o = 0; o < w.out; ++o)
    for (int64_t j = 0; j < w.in; ++j) d[o * w.in + column_of(w, j)] = stored_value(w, o, j);
  return out;
}

float quantize_row_s8(const float* x, int64_t n, int8_t* q) {
  float amax = 0.f;
  for (int64_t k = 0; k < n; ++k) amax = std::max(amax, std::fabs(x[k]));
  const float s = amax > 0 ? amax / 127.f : 1.f;
  for (int64_t k = 0; k < n; ++k)
    q[k] = static_cast<int8_t>(std::clamp(std::nearbyint(x[k] / s), -127.f, 127.f));
  return s;
}

void quant_matmul(const Tensor& x, const QuantWeight& w, Tensor& y) {
  const int64_t M = x.size(0);
  std::vector<float> xs(w.in);
  std::vector<int8_t> xq(w.in);
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x.data<float>() + m * x.stride(0);
    for (int64_t j = 0; j < w.in; ++j) {  // stored column order
      const int64_t k = column_of(w, j);
      float v = xr[k];
      if (w.smooth.defined()) v /= w.smooth.data<float>()[k];
      xs[j] = v;
    }
    float* yr = y.data<float>() + m * y.stride(0);
    if (w.scheme == QuantScheme::kW8A8) {
      const float sx = quantize_row_s8(xs.data(), w.in, xq.data());
      for (int64_t o = 0; o < w.out; ++o) {
        int64_t acc = 0;
        for (int64_t j = 0; j < w.in; ++j) acc += int64_t{xq[j]} * stored_code(w, o, j);
        yr[o] = static_cast<float>(static_cast<double>(acc) * sx * w.scales.data<float>()[o]);
      }
      continue;
    }
    for (int64_t o = 0; o < w.out; ++o) {
      double acc = 0;
      for (int64_t j = 0; j < w.in; ++j) acc += static_cast<double>(xs[j]) * stored_value(w, o, j);
      yr[o] = static_cast<float>(acc);
    }
  }
}

void quant_matmul_a8_runs(const Tensor& x, const QuantWeight& w, Tensor& y) {
  const int64_t M = x.size(0), G = w.in / w.group;
  std::vector<float> xs(w.in);
  std::vector<int8_t> xq(w.in);
  std::vector<float> sx(w.in / 32);
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x.data<float>() + m * x.stride(0);
    for (int64_t j = 0; j < w.in; ++j) {
      const int64_t k = column_of(w, j);
      xs[j] = w.smooth.defined() ? xr[k] / w.smooth.data<float>()[k] : xr[k];
    }
    for (int64_t b = 0; b < w.in / 32; ++b) sx[b] = quantize_row_s8(xs.data() + 32 * b, 32, xq.data() + 32 * b);
    float* yr = y.data<float>() + m * y.stride(0);
    for (int64_t o = 0; o < w.out; ++o) {
      double acc = 0;
      for (int64_t b = 0; b < w.in / 32; ++b) {
        int64_t dot = 0;
        for (int64_t j = 32 * b; j < 32 * b + 32; ++j) dot += int64_t{xq[j]} * stored_code(w, o, j);
        acc += static_cast<double>(dot) * sx[b] * w.scales.data<float>()[o * G + (32 * b) / w.group];
      }
      for (int64_t g = 0; g < G; ++g) {
        double sum = 0;
        for (int64_t j = g * w.group; j < (g + 1) * w.group; ++j) sum += xs[j];
        acc -= static_cast<double>(w.scales.data<float>()[o * G + g]) * w.zeros.data<float>()[o * G + g] * sum;
      }
      yr[o] = static_cast<float>(acc);
    }
  }
}

}  // namespace tessera::kernels::reference
