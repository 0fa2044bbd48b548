// Token (and position) embedding lookup and its gradient.
#pragma once
#include "tessera/tensor/tensor.h"

namespace tessera::kernels {

// out[n, :] = weight[ids[n], :]. weight (V, H) f32 or bf16; ids (N) i32; out (N, H) f32.
// If accumulate, out += instead of =. An id outside [0, V) throws tessera::Error naming it.
void embedding_forward(const Tensor& weight, const Tensor& ids, Tensor& out,
                       bool accumulate = false);
// dweight[ids[n], :] += dout[n, :]. dweight (V, H) f32.
void embedding_backward(const Tensor& dout, const Tensor& ids, Tensor& dweight);

}  // namespace tessera::kernels
