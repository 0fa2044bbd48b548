// Scalar reference versions of embedding.h (no id checks: tests pass valid ids).
#pragma once
#include "tessera/tensor/tensor.h"

namespace tessera::kernels::reference {

void embedding_forward(const Tensor& weight, const Tensor& ids, Tensor& out,
                       bool accumulate = false);
void embedding_backward(const Tensor& dout, const Tensor& ids, Tensor& dweight);

}  // namespace tessera::kernels::reference
