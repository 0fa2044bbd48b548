// Rotary position embedding, Hugging Face convention (rotate_half on the two
// contiguous halves of the rotated part of each head): x' = (x * cos + rotate_half(x) *
// sin) * attention_factor, with angle = position * inv_freq[i] in f32. The default
// frequencies are inv_freq[i] = 1 / theta^(2i / rotary_dim); scaled RoPE (linear, NTK,
// YaRN, Llama 3) passes its own. A partial rotary (rotary_dim < head_dim, as GPT-NeoX and
// Phi do) rotates the first rotary_dim features of each head and leaves the rest.
#pragma once
#include <cmath>
#include <vector>

#include "tessera/base/error.h"
#include "tessera/tensor/tensor.h"

namespace tessera::kernels {

struct RopeFreqs {
  std::vector<float> inv_freq;  // rotary_dim / 2 frequencies
  float attention_factor = 1.f;  // multiplies cos and sin (YaRN's mscale)
  int64_t rotary_dim() const { return 2 * static_cast<int64_t>(inv_freq.size()); }
};

// Hugging Face's default frequencies, computed as it does in f32:
// 1 / theta ** (arange(0, rotary_dim, 2).float() / rotary_dim). (Inline: config code
// computes them without the kernels.)
inline RopeFreqs rope_default_freqs(int64_t rotary_dim, float theta) {
  TESSERA_CHECK(std::isfinite(theta) && theta > 0.f, "rope_apply: theta must be positive, got ", theta);
  TESSERA_CHECK(rotary_dim > 0 && rotary_dim % 2 == 0, "rope_apply: the rotary dimension must be positive and even, "
                "got ", rotary_dim);
  RopeFreqs f;
  f.inv_freq.resize(static_cast<size_t>(rotary_dim / 2));
  for (int64_t i = 0; i < rotary_dim / 2; ++i)
    f.inv_freq[static_cast<size_t>(i)] =
        1.0f / std::pow(theta, static_cast<float>(2 * i) / static_cast<float>(rotary_dim));
  return f;
}

// x: (N, num_heads * head_dim) f32, rows may be strided; rotated in place.
// positions: (N) i32. inverse = true applies the transpose rotation (the backward pass).
void rope_apply(Tensor& x, int64_t head_dim, const Tensor& positions, const RopeFreqs& freqs,
                bool inverse = false);
// The default frequencies over the whole head.
void rope_apply(Tensor& x, int64_t head_dim, const Tensor& positions, float theta,
                bool inverse = false);

}  // namespace tessera::kernels
