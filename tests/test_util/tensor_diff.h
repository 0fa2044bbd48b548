// Element-wise comparisons of f32 tensors, and random ones, for tests.
#pragma once
#include <algorithm>
#include <cmath>
#include <random>

#include "tessera/tensor/tensor.h"

namespace tessera::testing {

// max |a - b| over contiguous f32 tensors of one size.
inline float max_abs_diff(const Tensor& a, const Tensor& b) {
  float d = 0;
  for (int64_t i = 0; i < a.numel(); ++i) d = std::max(d, std::fabs(a.data<float>()[i] - b.data<float>()[i]));
  return d;
}

// max |a|.
inline float max_abs(const Tensor& a) {
  float d = 0;
  for (int64_t i = 0; i < a.numel(); ++i) d = std::max(d, std::fabs(a.data<float>()[i]));
  return d;
}

// max |a - b| / max |b|: the error relative to the reference's scale (any strides).
inline float max_rel_diff(const Tensor& a, const Tensor& b) {
  const Tensor x = a.contiguous(), y = b.contiguous();
  float d = 0, m = 1e-30f;
  for (int64_t i = 0; i < y.numel(); ++i) {
    d = std::max(d, std::fabs(x.data<float>()[i] - y.data<float>()[i]));
    m = std::max(m, std::fabs(y.data<float>()[i]));
  }
  return d / m;
}

// f32 normal(0, sd) values from `rng`.
inline Tensor random_normal(const Shape& shape, std::mt19937& rng, float sd) {
  std::normal_distribution<float> n(0.f, sd);
  Tensor t = Tensor::empty(shape, DType::kF32);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = n(rng);
  return t;
}

}  // namespace tessera::testing
