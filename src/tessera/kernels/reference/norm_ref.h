// Scalar reference versions of norm.h (double-precision math), used only by tests.
#pragma once
#include "tessera/tensor/tensor.h"

namespace tessera::kernels::reference {

void rmsnorm_forward(const Tensor& x, const Tensor& weight, float eps, Tensor& out,
                     Tensor* rstd);
void rmsnorm_backward(const Tensor& dout, const Tensor& x, const Tensor& weight,
                      const Tensor& rstd, Tensor& dx, Tensor& dweight);
void layernorm_forward(const Tensor& x, const Tensor& weight, const Tensor& bias, float eps,
                       Tensor& out, Tensor* mean, Tensor* rstd);
void layernorm_backward(const Tensor& dout, const Tensor& x, const Tensor& weight,
                        const Tensor& mean, const Tensor& rstd, Tensor& dx, Tensor& dweight,
                        Tensor& dbias);
void add_rmsnorm_forward(Tensor& residual, const Tensor& delta, const Tensor& weight, float eps,
                         Tensor& out, Tensor* rstd);
void add_layernorm_forward(Tensor& residual, const Tensor& delta, const Tensor& weight,
                           const Tensor& bias, float eps, Tensor& out, Tensor* mean,
                           Tensor* rstd);

}  // namespace tessera::kernels::reference
