// CPU implementations behind elementwise.h; arguments are already checked by elementwise.cc.
#pragma once
#include "tessera/tensor/tensor.h"

namespace tessera::kernels::cpu {

void add_inplace(Tensor& a, const Tensor& b);
void add_bias(Tensor& x, const Tensor& bias);
void bias_backward(const Tensor& dout, Tensor& dbias);
void scale_inplace(Tensor& a, float s);

}  // namespace tessera::kernels::cpu
