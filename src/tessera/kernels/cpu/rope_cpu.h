// CPU implementation behind rope.h; arguments are already checked by rope.cc.
#pragma once
#include "tessera/kernels/rope.h"
#include "tessera/tensor/tensor.h"

namespace tessera::kernels::cpu {

void rope_apply(Tensor& x, int64_t head_dim, const Tensor& positions, const RopeFreqs& freqs,
                bool inverse);

}  // namespace tessera::kernels::cpu
