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
// x (contiguous f32) made into the operand the matmuls want, once, for an operand that
// feeds several matmuls and nothing else: rounded in place under the emulated modes;
// under kNative, x is replaced by its bf16 copy (half the bytes to keep for backward,
// and no matmul converts it again).
void round_matmul_input_in_place(Tensor& x, Bf16Mode mode);
// The same for an operand that also has other uses (an output gradient, whose f32 values
// the bias gradient sums): a new tensor, bf16 under kNative, as matmul_input otherwise.
Tensor matmul_operand(const Tensor& x, Bf16Mode mode);
// The mode to hand the functions below when the activation operands are already
// rounded (by matmul_input or round_matmul_input_in_place): under the emulated modes the
// weights are rounded f32 too, so the product is the plain f32 one (kOff); the others
// are unchanged.
Bf16Mode prepared_mode(Bf16Mode mode);

// y (N, out) = x (N, in) @ W^T  (x @ W for in_out weights); with_bias: + b, in the
// GEMM's epilogue where it can be (an f32 bias and a float weight), else added after.
void linear_matmul(const Linear& lin, const Tensor& x, Tensor& y, Bf16Mode mode, bool with_bias = false);
// y (N, out) = x (N, in) @ W^T + b  (x @ W + b for in_out weights).
void linear_forward(const Linear& lin, const Tensor& x, Tensor& y, Bf16Mode mode);
// dx (N, in) = dy (N, out) @ W (dy @ W^T for in_out); overwritten. A quantized weight
// (weight-only schemes) is dequantized for the product (LoRA over a quantized base).
void linear_backward_input(const Linear& lin, const Tensor& dy, Tensor& dx, Bf16Mode mode);
// grad.weight (+)= the weight gradient of x and dy_op, the matmul operands (rounded for
// `mode` here unless already prepared); grad.bias += column sums of dy, the unrounded
// output gradient that dy_op was made from (dy_op may be dy itself).
// With accumulate false, dW = the gradient (db is still added to).
void linear_backward_weight(const Tensor& x, const Tensor& dy, const Tensor& dy_op, Linear& grad,
                            Bf16Mode mode, bool accumulate = true);
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

}  // namespace tessera::model
