// CPU implementations behind norm.h; arguments are already checked by norm.cc.
#pragma once
#include "tessera/tensor/tensor.h"

namespace tessera::kernels::cpu {

// x (N, H); delta (N, H) or null. With delta, x is the residual stream and is updated
// (x += delta) in the same pass that gathers the row statistics.
void rmsnorm_forward(const Tensor& x, const Tensor* delta, const Tensor& weight, float eps,
                     Tensor& out, Tensor* rstd);
void layernorm_forward(const Tensor& x, const Tensor* delta, const Tensor& weight,
                       const Tensor& bias, float eps, Tensor& out, Tensor* mean, Tensor* rstd);

void rmsnorm_backward(const Tensor& dout, const Tensor& x, const Tensor& weight,
                      const Tensor& rstd, Tensor& dx, Tensor& dweight);
void layernorm_backward(const Tensor& dout, const Tensor& x, const Tensor& weight,
                        const Tensor& mean, const Tensor& rstd, Tensor& dx, Tensor& dweight,
                        Tensor& dbias);

}  // namespace tessera::kernels::cpu
