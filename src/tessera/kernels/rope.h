// Rotary position embedding, Hugging Face convention (rotate_half on the two
// contiguous halves of each head): x' = x * cos + rotate_half(x) * sin, with
// inv_freq[i] = 1 / theta^(2i / head_dim) and angle = position * inv_freq in f32.
#pragma once
#include "tessera/tensor/tensor.h"

namespace tessera::kernels {

// x: (N, num_heads * head_dim) f32, rows may be strided; rotated in place.
// positions: (N) i32. inverse = true applies the transpose rotation (the backward pass).
void rope_apply(Tensor& x, int64_t head_dim, const Tensor& positions, float theta,
                bool inverse = false);

}  // namespace tessera::kernels
