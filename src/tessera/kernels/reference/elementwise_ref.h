// Scalar reference versions of elementwise.h for 2-D (N, F) tensors, tests only.
#pragma once
#include "tessera/tensor/tensor.h"

namespace tessera::kernels::reference {

void add_inplace(Tensor& a, const Tensor& b);
void add_bias(Tensor& x, const Tensor& bias);
void bias_backward(const Tensor& dout, Tensor& dbias);  // column sums in double
void scale_inplace(Tensor& a, float s);                  // any contiguous f32

}  // namespace tessera::kernels::reference
