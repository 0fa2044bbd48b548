// Pointwise activations with their backward passes. 2-D (N, F) f32, last dim
// contiguous, rows may be strided (views into a fused gate|up buffer).
#pragma once
#include "tessera/tensor/tensor.h"

namespace tessera::kernels {

// out = silu(gate) * up
void swiglu_forward(const Tensor& gate, const Tensor& up, Tensor& out);
// dgate, dup overwritten
void swiglu_backward(const Tensor& dout, const Tensor& gate, const Tensor& up, Tensor& dgate,
                     Tensor& dup);

// out = gelu_tanh(gate) * up (GeGLU: Gemma's gelu_pytorch_tanh gated MLP)
void geglu_forward(const Tensor& gate, const Tensor& up, Tensor& out);
// dgate, dup overwritten
void geglu_backward(const Tensor& dout, const Tensor& gate, const Tensor& up, Tensor& dgate,
                    Tensor& dup);

// GELU, tanh approximation (GPT-2's gelu_new): 0.5x(1 + tanh(sqrt(2/pi)(x + 0.044715x^3)))
void gelu_forward(const Tensor& x, Tensor& out);  // out may alias x
void gelu_backward(const Tensor& dout, const Tensor& x, Tensor& dx);

// Row softmax over the last dim; out may alias x.
void softmax_forward(const Tensor& x, Tensor& out);
// dx = y * (dy - sum(dy * y))
void softmax_backward(const Tensor& dout, const Tensor& out, Tensor& dx);

}  // namespace tessera::kernels
