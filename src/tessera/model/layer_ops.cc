// Linear and norm helpers over the kernels.
#include "tessera/model/layer_ops.h"

#include "tessera/kernels/elementwise.h"
#include "tessera/kernels/matmul.h"
#include "tessera/kernels/norm.h"
#include "tessera/kernels/quant.h"

namespace tessera::model {

int64_t linear_out_features(const Linear& lin) {
  if (lin.quant) return lin.quant->out;
  return lin.in_out ? lin.weight.size(1) : lin.weight.size(0);
}

Tensor matmul_input(const Tensor& x, Bf16Mode mode) {
  // kNative needs nothing: matmul rounds an f32 operand paired with bf16 weights.
  if (mode == Bf16Mode::kEmulated) return bf16_rounded(x);
  if (mode == Bf16Mode::kEmulatedF16) return f16_rounded(x);
  return x;
}

void round_matmul_input_in_place(Tensor& x, Bf16Mode mode) {
  if (mode == Bf16Mode::kEmulated) round_bf16_in_place(x);
  if (mode == Bf16Mode::kEmulatedF16) round_f16_in_place(x);
  if (mode == Bf16Mode::kNative) x = x.to(DType::kBF16);
}

Tensor matmul_operand(const Tensor& x, Bf16Mode mode) {
  return mode == Bf16Mode::kNative ? x.to(DType::kBF16) : matmul_input(x, mode);
}

Bf16Mode prepared_mode(Bf16Mode mode) {
  return mode == Bf16Mode::kEmulated || mode == Bf16Mode::kEmulatedF16 ? Bf16Mode::kOff : mode;
}

void linear_matmul(const Linear& lin, const Tensor& x, Tensor& y, Bf16Mode mode, bool with_bias) {
  const bool bias = with_bias && lin.bias.defined();
  if (kernels::takes_packed(lin.packed_fwd, x.size(0)) && (!bias || lin.bias.dtype() == DType::kF32))
    return kernels::matmul_packed(x, lin.packed_fwd, y, bias ? &lin.bias : nullptr);
  if (lin.quant)  // activations stay f32 (W8A16 / W4A16; W8A8 quantizes them itself)
    kernels::quant_matmul(x.dtype() == DType::kF32 ? x : x.to(DType::kF32), *lin.quant, y);
  else if (bias && lin.bias.dtype() == DType::kF32)
    return kernels::matmul_bias(matmul_input(x, mode), lin.weight, lin.bias, y, !lin.in_out);
  else
    kernels::matmul(matmul_input(x, mode), lin.weight, y, false, !lin.in_out);
  if (bias) kernels::add_bias(y, lin.bias);  // (a quantized or bf16 bias)
}

void linear_forward(const Linear& lin, const Tensor& x, Tensor& y, Bf16Mode mode) {
  linear_matmul(lin, x, y, mode, true);
}

void linear_backward_input(const Linear& lin, const Tensor& dy, Tensor& dx, Bf16Mode mode) {
  if (lin.quant) {  // a frozen quantized base (QLoRA): through its dequantized weight, one linear at a time
    kernels::matmul(matmul_input(dy, mode), kernels::dequantize(*lin.quant), dx, false, false);
    if (lin.quant->smooth.defined()) {  // y = (x / smooth) W^T: dx = (dy W) / smooth
      const float* sm = lin.quant->smooth.data<float>();
      for (int64_t n = 0; n < dx.size(0); ++n) {
        float* row = dx.data<float>() + n * dx.stride(0);
        for (int64_t k = 0; k < dx.size(1); ++k) row[k] /= sm[k];
      }
    }
    return;
  }
  if (kernels::takes_packed(lin.packed_dx, dy.size(0))) return kernels::matmul_packed(dy, lin.packed_dx, dx);
  kernels::matmul(matmul_input(dy, mode), lin.weight, dx, false, lin.in_out);
}

void matmul_weight_grad(const Tensor& a, const Tensor& b, Tensor& dw, Bf16Mode mode,
                        bool accumulate) {
  const float beta = accumulate ? 1.f : 0.f;
  switch (mode) {
    case Bf16Mode::kOff: kernels::matmul(a, b, dw, true, false, 1.f, beta); break;
    case Bf16Mode::kNative:
      kernels::matmul(a.to(DType::kBF16), b.to(DType::kBF16), dw, true, false, 1.f, beta);
      break;
    case Bf16Mode::kEmulated:
    case Bf16Mode::kEmulatedF16:
      kernels::matmul(matmul_input(a, mode), matmul_input(b, mode), dw, true, false, 1.f, beta);
      break;
  }
}

void linear_backward_weight(const Tensor& x, const Tensor& dy, const Tensor& dy_op, Linear& grad,
                            Bf16Mode mode, bool accumulate) {
  if (grad.in_out)  // W (in, out): dW += x^T dy
    matmul_weight_grad(x, dy_op, grad.weight, mode, accumulate);
  else  // W (out, in): dW += dy^T x
    matmul_weight_grad(dy_op, x, grad.weight, mode, accumulate);
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

}  // namespace tessera::model
