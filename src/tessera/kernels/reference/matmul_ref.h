// Scalar matmul used as the independent reference in tests (double accumulation).
#pragma once
#include "tessera/tensor/tensor.h"

namespace tessera::kernels::reference {

// Same contract as kernels::matmul: c(M, N) = alpha * op(a) @ op(b) + beta * c.
// Reads any strides; when a and b differ in dtype the f32 operand is rounded to
// bf16 first (autocast semantics). beta == 0 never reads c.
void matmul(const Tensor& a, const Tensor& b, Tensor& c, bool trans_a, bool trans_b,
            float alpha, float beta);

}  // namespace tessera::kernels::reference
