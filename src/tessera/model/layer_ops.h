// Building blocks shared by the inference and training paths: linear layers and
// norms that pick RMSNorm or LayerNorm from the config. Internal to model/.
#pragma once
#include "tessera/model/config.h"
#include "tessera/model/model.h"
#include "tessera/model/params.h"
#include "tessera/tensor/tensor.h"

namespace tessera::model {

// The activation operand of a matmul as the bf16 mode wants it (rounded under kEmulated).
Tensor matmul_input(const Tensor& x, Bf16Mode mode);

// y (N, out) = x (N, in) @ W^T + b  (x @ W + b for in_out weights).
void linear_forward(const Linear& lin, const Tensor& x, Tensor& y, Bf16Mode mode);
// dx (N, in) = dy (N, out) @ W (dy @ W^T for in_out); overwritten.
void linear_backward_input(const Linear& lin, const Tensor& dy, Tensor& dx, Bf16Mode mode);
// grad.weight += dW, grad.bias += column sums of dy. Under a bf16 mode the operands of
// the weight-gradient matmul are rounded to bf16 first (autocast semantics).
// dW (and db) += the gradient; with accumulate false, dW = it (db is still added to).
void linear_backward_weight(const Tensor& x, const Tensor& dy, Linear& grad, Bf16Mode mode,
                            bool accumulate = true);
// dW += op(a)^T b for a weight gradient: the two operands rounded as the mode wants.
void matmul_weight_grad(const Tensor& a, const Tensor& b, Tensor& dw, Bf16Mode mode,
                        bool accumulate = true);
int64_t linear_out_features(const Linear& lin);

// out = norm(x); mean/rstd saved when given (mean only for LayerNorm).
void norm_forward(const ModelConfig& c, const Tensor& w, const Tensor& b, const Tensor& x,
                  Tensor& out, Tensor* mean, Tensor* rstd);
// residual += delta; out = norm(residual).
void add_norm_forward(const ModelConfig& c, const Tensor& w, const Tensor& b, Tensor& residual,
                      const Tensor& delta, Tensor& out, Tensor* mean, Tensor* rstd);
// dx overwritten; dw, db accumulated.
void norm_backward(const ModelConfig& c, const Tensor& dout, const Tensor& x, const Tensor& w,
                   const Tensor& mean, const Tensor& rstd, Tensor& dx, Tensor& dw, Tensor& db);

// Views of the fused (rows, Q + 2 KV) QKV buffer as (B, T, heads, head_dim).
struct QkvViews {
  Tensor q, k, v;
};
QkvViews qkv_views(const ModelConfig& c, const Tensor& qkv, int64_t B, int64_t T);

}  // namespace tessera::model
