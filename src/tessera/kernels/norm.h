// RMSNorm and LayerNorm over the last dim, forward and backward, plus the fused
// residual-add + norm used between transformer blocks.
// All 2-D tensors here: (N, H), last dim contiguous, row stride may be larger than H.
// Activations are f32; norm weights/biases may be f32 or bf16. Gradients are f32.
#pragma once
#include "tessera/tensor/tensor.h"

namespace tessera::kernels {

// out = x * rstd * weight, rstd = 1 / sqrt(mean(x^2) + eps). rstd: (N) f32, optional.
void rmsnorm_forward(const Tensor& x, const Tensor& weight, float eps, Tensor& out,
                     Tensor* rstd);
// dx is overwritten; dweight (H) f32 is accumulated into.
void rmsnorm_backward(const Tensor& dout, const Tensor& x, const Tensor& weight,
                      const Tensor& rstd, Tensor& dx, Tensor& dweight);

// out = (x - mean) * rstd * weight + bias. mean, rstd: (N) f32, optional.
void layernorm_forward(const Tensor& x, const Tensor& weight, const Tensor& bias, float eps,
                       Tensor& out, Tensor* mean, Tensor* rstd);
// dx overwritten; dweight, dbias (H) f32 accumulated into.
void layernorm_backward(const Tensor& dout, const Tensor& x, const Tensor& weight,
                        const Tensor& mean, const Tensor& rstd, Tensor& dx, Tensor& dweight,
                        Tensor& dbias);

// Fused: residual += delta; out = rmsnorm(residual). One pass over memory.
void add_rmsnorm_forward(Tensor& residual, const Tensor& delta, const Tensor& weight, float eps,
                         Tensor& out, Tensor* rstd);
// Fused: residual += delta; out = layernorm(residual).
void add_layernorm_forward(Tensor& residual, const Tensor& delta, const Tensor& weight,
                           const Tensor& bias, float eps, Tensor& out, Tensor* mean,
                           Tensor* rstd);

}  // namespace tessera::kernels
