// CPU implementations behind activation.h; arguments are already checked by activation.cc.
#pragma once
#include "tessera/tensor/tensor.h"

namespace tessera::kernels::cpu {

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

}  // namespace tessera::kernels::cpu
