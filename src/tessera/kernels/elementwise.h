// Small elementwise helpers used between the big ops. 2-D (N, F) f32 unless said,
// last dim contiguous, rows may be strided.
#pragma once
#include "tessera/tensor/tensor.h"

namespace tessera::kernels {

void add_inplace(Tensor& a, const Tensor& b);            // a += b (same shape)
void add_bias(Tensor& x, const Tensor& bias);            // x[n, :] += bias; bias (F) f32 or bf16
void bias_backward(const Tensor& dout, Tensor& dbias);   // dbias (F) f32 += column sums of dout
void scale_inplace(Tensor& a, float s);                  // a *= s (any contiguous f32)

}  // namespace tessera::kernels
