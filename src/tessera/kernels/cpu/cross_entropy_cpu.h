// CPU implementation behind cross_entropy.h; arguments (targets included) are already
// checked by cross_entropy.cc.
#pragma once
#include "tessera/kernels/cross_entropy.h"

namespace tessera::kernels::cpu {

CrossEntropyResult cross_entropy(const Tensor& logits, const Tensor& targets, Tensor* losses,
                                 Tensor* dlogits, float grad_scale);

CrossEntropyResult cross_entropy_columns(const Tensor& logits_t, const Tensor& targets,
                                         float grad_scale, Tensor* exps_t, Tensor* col_scale);

}  // namespace tessera::kernels::cpu
