// Entry points of activation.h: check that every operand is an (N, F) f32 row view of
// one shape, then run the CPU kernels.
#include "tessera/kernels/activation.h"
#include "tessera/kernels/dispatch.h"

#include <initializer_list>
#include <utility>

#include "tessera/kernels/cpu/activation_cpu.h"
#include "tessera/kernels/pointwise_checks.h"

namespace tessera::kernels {
namespace {

using detail::check_rows;

// Checks `first` and returns its shape for the other operands to match.
std::pair<int64_t, int64_t> check_first(const Tensor& first, const char* op, const char* name) {
  check_rows(first, op, name, DType::kF32);
  return {first.size(0), first.size(1)};
}

// A gated activation's operands: gate, up, out (and dout, dgate, dup) one (N, F) shape.
void check_gated(const char* op, const Tensor& gate, std::initializer_list<std::pair<const char*, const Tensor*>> rest) {
  const auto [N, F] = check_first(gate, op, "gate");
  for (const auto& [name, t] : rest) check_rows(*t, op, name, DType::kF32, N, F);
}

}  // namespace

void swiglu_forward(const Tensor& gate, const Tensor& up, Tensor& out) {
  check_gated("swiglu_forward", gate, {{"up", &up}, {"out", &out}});
  TESSERA_KERNEL("swiglu_forward", cpu::swiglu_forward(gate, up, out), gate, up, out);
}

void swiglu_backward(const Tensor& dout, const Tensor& gate, const Tensor& up, Tensor& dgate,
                     Tensor& dup) {
  check_gated("swiglu_backward", gate, {{"dout", &dout}, {"up", &up}, {"dgate", &dgate}, {"dup", &dup}});
  TESSERA_KERNEL("swiglu_backward", cpu::swiglu_backward(dout, gate, up, dgate, dup), dout, gate, up, dgate, dup);
}

void geglu_forward(const Tensor& gate, const Tensor& up, Tensor& out) {
  check_gated("geglu_forward", gate, {{"up", &up}, {"out", &out}});
  TESSERA_KERNEL("geglu_forward", cpu::geglu_forward(gate, up, out), gate, up, out);
}

void geglu_backward(const Tensor& dout, const Tensor& gate, const Tensor& up, Tensor& dgate,
                    Tensor& dup) {
  check_gated("geglu_backward", gate, {{"dout", &dout}, {"up", &up}, {"dgate", &dgate}, {"dup", &dup}});
  TESSERA_KERNEL("geglu_backward", cpu::geglu_backward(dout, gate, up, dgate, dup), dout, gate, up, dgate, dup);
}

void gelu_forward(const Tensor& x, Tensor& out) {
  const char* op = "gelu_forward";
  const auto [N, F] = check_first(x, op, "x");
  check_rows(out, op, "out", DType::kF32, N, F);
  TESSERA_KERNEL(op, cpu::gelu_forward(x, out), x, out);
}

void gelu_backward(const Tensor& dout, const Tensor& x, Tensor& dx) {
  const char* op = "gelu_backward";
  const auto [N, F] = check_first(x, op, "x");
  check_rows(dout, op, "dout", DType::kF32, N, F);
  check_rows(dx, op, "dx", DType::kF32, N, F);
  TESSERA_KERNEL(op, cpu::gelu_backward(dout, x, dx), dout, x, dx);
}

void softmax_forward(const Tensor& x, Tensor& out) {
  const char* op = "softmax_forward";
  const auto [N, F] = check_first(x, op, "x");
  TESSERA_CHECK(F >= 1, op, ": x ", x.describe(), " has no columns to normalise over");
  check_rows(out, op, "out", DType::kF32, N, F);
  TESSERA_KERNEL(op, cpu::softmax_forward(x, out), x, out);
}

void softmax_backward(const Tensor& dout, const Tensor& out, Tensor& dx) {
  const char* op = "softmax_backward";
  const auto [N, F] = check_first(out, op, "out");
  check_rows(dout, op, "dout", DType::kF32, N, F);
  check_rows(dx, op, "dx", DType::kF32, N, F);
  TESSERA_KERNEL(op, cpu::softmax_backward(dout, out, dx), dout, out, dx);
}

}  // namespace tessera::kernels
