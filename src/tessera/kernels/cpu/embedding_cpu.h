// CPU implementations behind embedding.h; arguments (ids included) are already checked
// by embedding.cc.
#pragma once
#include "tessera/tensor/tensor.h"

namespace tessera::kernels::cpu {

void embedding_forward(const Tensor& weight, const Tensor& ids, Tensor& out, bool accumulate);
void embedding_backward(const Tensor& dout, const Tensor& ids, Tensor& dweight);

}  // namespace tessera::kernels::cpu
