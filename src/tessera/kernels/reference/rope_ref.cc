// Scalar reference RoPE. The angle is formed in f32 exactly as Hugging Face does (the
// f32 rounding of position * inv_freq is part of the model's numerics); cos, sin, the
// attention factor and the rotation itself are done in double.
#include "tessera/kernels/reference/rope_ref.h"

#include <cmath>

#include "tessera/kernels/reference/reference_util.h"

namespace tessera::kernels::reference {

void rope_apply(Tensor& x, int64_t head_dim, const Tensor& positions, const RopeFreqs& freqs,
                bool inverse) {
  const int64_t N = x.size(0), half = freqs.rotary_dim() / 2, heads = x.size(1) / head_dim;
  for (int64_t n = 0; n < N; ++n) {
    const float pos = static_cast<float>(positions.data<int32_t>()[n]);
    float* row = ref_row<float>(x, n);
    for (int64_t i = 0; i < half; ++i) {
      const float angle = pos * freqs.inv_freq[i];
      const double c = freqs.attention_factor * std::cos(static_cast<double>(angle));
      const double s = (inverse ? -1.0 : 1.0) * freqs.attention_factor * std::sin(static_cast<double>(angle));
      for (int64_t h = 0; h < heads; ++h) {
        float* v = row + h * head_dim;
        const double x1 = v[i], x2 = v[i + half];
        v[i] = static_cast<float>(x1 * c - x2 * s);
        v[i + half] = static_cast<float>(x2 * c + x1 * s);
      }
    }
  }
}

void rope_apply(Tensor& x, int64_t head_dim, const Tensor& positions, float theta, bool inverse) {
  RopeFreqs f;
  f.inv_freq.resize(head_dim / 2);
  for (int64_t i = 0; i < head_dim / 2; ++i)
    f.inv_freq[i] = 1.0f / powf(theta, static_cast<float>(2 * i) / static_cast<float>(head_dim));
  reference::rope_apply(x, head_dim, positions, f, inverse);
}

}  // namespace tessera::kernels::reference
