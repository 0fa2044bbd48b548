// Scalar reference versions of activation.h (literal formulas in double), tests only.
#pragma once
#include "tessera/tensor/tensor.h"

namespace tessera::kernels::reference {

void swiglu_forward(const Tensor& gate, const Tensor& up, Tensor& out);
void swiglu_backward(const Tensor& dout, const Tensor& gate, const Tensor& up, Tensor& dgate,
                     Tensor& dup);
void geglu_forward(const Tensor& gate, const Tensor& up, Tensor& out);
void geglu_backward(const Tensor& dout, const Tensor& gate, const Tensor& up, Tensor& dgate,
                    Tensor& dup);
void gelu_forward(const Tensor& x, Tensor& out);
void gelu_backward(const Tensor& dout, const Tensor& x, Tensor& dx);
void softmax_forward(const Tensor& x, Tensor& out);
void softmax_backward(const Tensor& dout, const Tensor& out, Tensor& dx);

}  // namespace tessera::kernels::reference
