// Entry points of embedding.h: shape checks, and every id validated before any thread
// starts (an exception must not escape an OpenMP region).
#include "tessera/kernels/embedding.h"
#include "tessera/kernels/dispatch.h"

#include "tessera/kernels/cpu/embedding_cpu.h"
#include "tessera/kernels/pointwise_checks.h"

namespace tessera::kernels {
namespace {

void check_ids(const Tensor& ids, int64_t vocab, const char* op) {
  const int32_t* id = ids.data<int32_t>();
  for (int64_t n = 0; n < ids.numel(); ++n)
    TESSERA_CHECK(id[n] >= 0 && id[n] < vocab, op, ": ids[", n, "] = ", id[n],
                  " is out of range for vocab size ", vocab);
}

}  // namespace

void embedding_forward(const Tensor& weight, const Tensor& ids, Tensor& out, bool accumulate) {
  const char* op = "embedding_forward";
  TESSERA_CHECK(weight.defined(), op, ": weight is undefined");
  TESSERA_CHECK(weight.dtype() == DType::kF32 || weight.dtype() == DType::kBF16, op,
                ": weight must be f32 or bf16, got ", weight.describe());
  detail::check_rows(weight, op, "weight", weight.dtype());
  detail::check_rows(out, op, "out", DType::kF32);
  detail::check_vector(ids, op, "ids", out.size(0), {DType::kI32});
  TESSERA_CHECK(out.size(1) == weight.size(1), op, ": out ", out.describe(), " and weight ",
                weight.describe(), " differ in hidden size");
  check_ids(ids, weight.size(0), op);
  TESSERA_KERNEL(op, cpu::embedding_forward(weight, ids, out, accumulate), weight, ids, out);
}

void embedding_backward(const Tensor& dout, const Tensor& ids, Tensor& dweight) {
  const char* op = "embedding_backward";
  detail::check_rows(dweight, op, "dweight", DType::kF32);
  detail::check_rows(dout, op, "dout", DType::kF32);
  detail::check_vector(ids, op, "ids", dout.size(0), {DType::kI32});
  TESSERA_CHECK(dout.size(1) == dweight.size(1), op, ": dout ", dout.describe(),
                " and dweight ", dweight.describe(), " differ in hidden size");
  check_ids(ids, dweight.size(0), op);
  TESSERA_KERNEL(op, cpu::embedding_backward(dout, ids, dweight), dout, ids, dweight);
}

}  // namespace tessera::kernels
