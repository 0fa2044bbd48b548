// Scalar reference of rope.h (rotation in double of f32 angles), used only by tests.
#pragma once
#include "tessera/kernels/rope.h"
#include "tessera/tensor/tensor.h"

namespace tessera::kernels::reference {

void rope_apply(Tensor& x, int64_t head_dim, const Tensor& positions, const RopeFreqs& freqs,
                bool inverse = false);
void rope_apply(Tensor& x, int64_t head_dim, const Tensor& positions, float theta,
                bool inverse = false);

}  // namespace tessera::kernels::reference
