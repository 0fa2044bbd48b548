// Linear and norm helpers over the kernels.
#include "tessera/model/layer_ops.h"

#include "tessera/kernels/elementwise.h"
#include "tessera/kernels/matmul.h"
#include "tessera/kernels/norm.h"

namespace tessera::model {

int64_t linear_out_features(const Linear& lin) {
  return lin.in_out ? lin.weight.size(1) : lin.weight.size(0);
}

void linear_forward(const Linear& lin, const Tensor& x, Tensor& y) {
  kernels::matmul(x, lin.weight, y, false, !lin.in_out);
  if (lin.bias.defined()) kernels::add_bias(y, lin.bias);
}

void linear_backward_input(const Linear& lin, const Tensor& dy, Tensor& dx) {
  kernels::matmul(dy, lin.weight, dx, false, lin.in_out);
}

void linear_backward_weight(const Tensor& x, const Tensor& dy, Linear& grad, bool bf16) {
  Tensor xa = x, dya = dy;
  if (bf16) {
    xa = x.to(DType::kBF16);
    dya = dy.to(DType::kBF16);
  }
  if (grad.in_out)  // W (in, out): dW += x^T dy
    kernels::matmul(xa, dya, grad.weight, true, false, 1.f, 1.f);
  else  // W (out, in): dW += dy^T x
    kernels::matmul(dya, xa, grad.weight, true, false, 1.f, 1.f);
  if (grad.bias.defined()) kernels::bias_backward(dy, grad.bias);
}

void norm_forward(const ModelConfig& c, const Tensor& w, const Tensor& b, const Tensor& x,
                  Tensor& out, Tensor* mean, Tensor* rstd) {
  if (c.uses_layernorm())
    kernels::layernorm_forward(x, w, b, c.norm_eps, out, mean, rstd);
  else
    kernels::rmsnorm_forward(x, w, c.norm_eps, out, rstd);
}

void add_norm_forward(const ModelConfig& c, const Tensor& w, const Tensor& b, Tensor& residual,
                      const Tensor& delta, Tensor& out, Tensor* mean, Tensor* rstd) {
  if (c.uses_layernorm())
    kernels::add_layernorm_forward(residual, delta, w, b, c.norm_eps, out, mean, rstd);
  else
    kernels::add_rmsnorm_forward(residual, delta, w, c.norm_eps, out, rstd);
}

void norm_backward(const ModelConfig& c, const Tensor& dout, const Tensor& x, const Tensor& w,
                   const Tensor& mean, const Tensor& rstd, Tensor& dx, Tensor& dw, Tensor& db) {
  if (c.uses_layernorm())
    kernels::layernorm_backward(dout, x, w, mean, rstd, dx, dw, db);
  else
    kernels::rmsnorm_backward(dout, x, w, rstd, dx, dw);
}

QkvViews qkv_views(const ModelConfig& c, const Tensor& qkv, int64_t B, int64_t T) {
  const int64_t W = qkv.stride(0), D = c.head_dim;
  const int64_t Q = c.q_dim(), KV = c.kv_dim();
  QkvViews v;
  v.q = qkv.as_strided({B, T, c.num_heads, D}, {T * W, W, D, 1}, 0);
  v.k = qkv.as_strided({B, T, c.num_kv_heads, D}, {T * W, W, D, 1}, Q);
  v.v = qkv.as_strided({B, T, c.num_kv_heads, D}, {T * W, W, D, 1}, Q + KV);
  return v;
}

}  // namespace tessera::model
