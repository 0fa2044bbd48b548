// Scalar reference RoPE. The angle is formed in f32 exactly as Hugging Face does (the
// f32 rounding of position * inv_freq is part of the model's numerics); cos, sin and the
// rotation itself are done in double.
#include "tessera/kernels/reference/rope_ref.h"

#include <cmath>

#include "tessera/kernels/reference/reference_util.h"

namespace tessera::kernels::reference {

void rope_apply(Tensor& x, int64_t head_dim, const Tensor& positions, float theta,
                bool inverse) {
  const int64_t N = x.size(0), half = head_dim / 2, heads = x.size(1) / head_dim;
  for (int64_t n = 0; n < N; ++n) {
    const float pos = static_cast<float>(positions.data<int32_t>()[n]);
    float* row = ref_row<float>(x, n);
    for (int64_t i = 0; i < half; ++i) {
      const float inv_freq =
          1.0f / powf(theta, static_cast<float>(2 * i) / static_cast<float>(head_dim));
      const float angle = pos * inv_freq;
      const double c = std::cos(static_cast<double>(angle));
      const double s = (inverse ? -1.0 : 1.0) * std::sin(static_cast<double>(angle));
      for (int64_t h = 0; h < heads; ++h) {
        float* v = row + h * head_dim;
        const double x1 = v[i], x2 = v[i + half];
        v[i] = static_cast<float>(x1 * c - x2 * s);
        v[i + half] = static_cast<float>(x2 * c + x1 * s);
      }
    }
  }
}

}  // namespace tessera::kernels::reference
