// Entry points of norm.h: check shapes, dtypes and layouts, then run the CPU kernels.
#include "tessera/kernels/norm.h"
#include "tessera/kernels/dispatch.h"

#include "tessera/kernels/cpu/norm_cpu.h"
#include "tessera/kernels/pointwise_checks.h"

namespace tessera::kernels {
namespace {

using detail::check_rows;
using detail::check_vector;

// x (N, H) f32 with H >= 1; returns H.
int64_t check_input(const Tensor& x, const char* op, const char* name) {
  check_rows(x, op, name, DType::kF32);
  TESSERA_CHECK(x.size(1) >= 1, op, ": ", name, " ", x.describe(), " has no columns");
  return x.size(1);
}

void check_params(const Tensor& weight, const Tensor* bias, int64_t H, const char* op) {
  check_vector(weight, op, "weight", H, {DType::kF32, DType::kBF16});
  if (bias) {
    check_vector(*bias, op, "bias", H, {DType::kF32, DType::kBF16});
    TESSERA_CHECK(bias->dtype() == weight.dtype(), op, ": bias ", bias->describe(),
                  " must have the dtype of weight ", weight.describe());
  }
}

void check_stat(const Tensor* t, int64_t N, const char* op, const char* name) {
  if (t) check_vector(*t, op, name, N, {DType::kF32});
}

}  // namespace

void rmsnorm_forward(const Tensor& x, const Tensor& weight, float eps, Tensor& out,
                     Tensor* rstd) {
  const char* op = "rmsnorm_forward";
  const int64_t H = check_input(x, op, "x");
  const int64_t N = x.size(0);
  check_params(weight, nullptr, H, op);
  check_rows(out, op, "out", DType::kF32, N, H);
  check_stat(rstd, N, op, "rstd");
  TESSERA_KERNEL(op, cpu::rmsnorm_forward(x, nullptr, weight, eps, out, rstd), x, weight, out);
}

void rmsnorm_backward(const Tensor& dout, const Tensor& x, const Tensor& weight,
                      const Tensor& rstd, Tensor& dx, Tensor& dweight) {
  const char* op = "rmsnorm_backward";
  const int64_t H = check_input(x, op, "x");
  const int64_t N = x.size(0);
  check_rows(dout, op, "dout", DType::kF32, N, H);
  check_params(weight, nullptr, H, op);
  check_stat(&rstd, N, op, "rstd");
  check_rows(dx, op, "dx", DType::kF32, N, H);
  check_vector(dweight, op, "dweight", H, {DType::kF32});
  TESSERA_KERNEL(op, cpu::rmsnorm_backward(dout, x, weight, rstd, dx, dweight), dout, x, weight, dx, dweight);
}

void layernorm_forward(const Tensor& x, const Tensor& weight, const Tensor& bias, float eps,
                       Tensor& out, Tensor* mean, Tensor* rstd) {
  const char* op = "layernorm_forward";
  const int64_t H = check_input(x, op, "x");
  const int64_t N = x.size(0);
  check_params(weight, &bias, H, op);
  check_rows(out, op, "out", DType::kF32, N, H);
  check_stat(mean, N, op, "mean");
  check_stat(rstd, N, op, "rstd");
  TESSERA_KERNEL(op, cpu::layernorm_forward(x, nullptr, weight, bias, eps, out, mean, rstd), x, weight, out);
}

void layernorm_backward(const Tensor& dout, const Tensor& x, const Tensor& weight,
                        const Tensor& mean, const Tensor& rstd, Tensor& dx, Tensor& dweight,
                        Tensor& dbias) {
  const char* op = "layernorm_backward";
  const int64_t H = check_input(x, op, "x");
  const int64_t N = x.size(0);
  check_rows(dout, op, "dout", DType::kF32, N, H);
  check_params(weight, nullptr, H, op);
  check_stat(&mean, N, op, "mean");
  check_stat(&rstd, N, op, "rstd");
  check_rows(dx, op, "dx", DType::kF32, N, H);
  check_vector(dweight, op, "dweight", H, {DType::kF32});
  check_vector(dbias, op, "dbias", H, {DType::kF32});
  TESSERA_KERNEL(op, cpu::layernorm_backward(dout, x, weight, mean, rstd, dx, dweight, dbias), dout, x, weight, dx, dweight);
}

void add_rmsnorm_forward(Tensor& residual, const Tensor& delta, const Tensor& weight, float eps,
                         Tensor& out, Tensor* rstd) {
  const char* op = "add_rmsnorm_forward";
  const int64_t H = check_input(residual, op, "residual");
  const int64_t N = residual.size(0);
  check_rows(delta, op, "delta", DType::kF32, N, H);
  check_params(weight, nullptr, H, op);
  check_rows(out, op, "out", DType::kF32, N, H);
  check_stat(rstd, N, op, "rstd");
  TESSERA_KERNEL(op, cpu::rmsnorm_forward(residual, &delta, weight, eps, out, rstd), residual, delta, weight, out);
}

void add_layernorm_forward(Tensor& residual, const Tensor& delta, const Tensor& weight,
                           const Tensor& bias, float eps, Tensor& out, Tensor* mean,
                           Tensor* rstd) {
  const char* op = "add_layernorm_forward";
  const int64_t H = check_input(residual, op, "residual");
  const int64_t N = residual.size(0);
  check_rows(delta, op, "delta", DType::kF32, N, H);
  check_params(weight, &bias, H, op);
  check_rows(out, op, "out", DType::kF32, N, H);
  check_stat(mean, N, op, "mean");
  check_stat(rstd, N, op, "rstd");
  TESSERA_KERNEL(op, cpu::layernorm_forward(residual, &delta, weight, bias, eps, out, mean, rstd), residual, delta, weight, out);
}

}  // namespace tessera::kernels
