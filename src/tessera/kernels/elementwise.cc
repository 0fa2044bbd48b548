// Entry points of elementwise.h: shape / layout checks, then the CPU kernels.
#include "tessera/kernels/elementwise.h"
#include "tessera/kernels/dispatch.h"

#include "tessera/kernels/cpu/elementwise_cpu.h"
#include "tessera/kernels/pointwise_checks.h"

namespace tessera::kernels {

void add_inplace(Tensor& a, const Tensor& b) {
  const char* op = "add_inplace";
  detail::check_row_major(a, op, "a");
  detail::check_row_major(b, op, "b");
  TESSERA_CHECK(a.shape() == b.shape(), op, ": b ", b.describe(), " does not match a ",
                a.describe());
  TESSERA_KERNEL(op, cpu::add_inplace(a, b), a, b);
}

void add_bias(Tensor& x, const Tensor& bias) {
  const char* op = "add_bias";
  detail::check_row_major(x, op, "x");
  detail::check_vector(bias, op, "bias", x.size(-1), {DType::kF32, DType::kBF16});
  TESSERA_KERNEL(op, cpu::add_bias(x, bias), x, bias);
}

void bias_backward(const Tensor& dout, Tensor& dbias) {
  const char* op = "bias_backward";
  detail::check_row_major(dout, op, "dout");
  detail::check_vector(dbias, op, "dbias", dout.size(-1), {DType::kF32});
  TESSERA_KERNEL(op, cpu::bias_backward(dout, dbias), dout, dbias);
}

void scale_inplace(Tensor& a, float s) {
  const char* op = "scale_inplace";
  TESSERA_CHECK(a.defined(), op, ": a is undefined");
  TESSERA_CHECK(a.device() == Device::kCPU, op, ": a ", a.describe(), " is not on the CPU");
  TESSERA_CHECK(a.dtype() == DType::kF32, op, ": a must be f32, got ", a.describe());
  TESSERA_CHECK(a.is_contiguous(), op, ": a ", a.describe(), " must be contiguous");
  TESSERA_KERNEL(op, cpu::scale_inplace(a, s), a);
}

}  // namespace tessera::kernels
