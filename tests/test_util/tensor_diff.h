// Element-wise comparisons of f32 tensors for tests.
#pragma once
#include <algorithm>
#include <cmath>

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

}  // namespace tessera::testing
