// Scalar reference version of cross_entropy.h (double math, no target checks), tests only.
#pragma once
#include "tessera/kernels/cross_entropy.h"

namespace tessera::kernels::reference {

CrossEntropyResult cross_entropy(const Tensor& logits, const Tensor& targets, Tensor* losses,
                                 Tensor* dlogits, float grad_scale);

}  // namespace tessera::kernels::reference
