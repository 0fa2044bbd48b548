// Entry point of cross_entropy.h: shape checks, and every target validated before any
// thread starts (an exception must not escape an OpenMP region).
#include "tessera/kernels/cross_entropy.h"
#include "tessera/kernels/dispatch.h"

#include "tessera/kernels/cpu/cross_entropy_cpu.h"
#include "tessera/kernels/pointwise_checks.h"

namespace tessera::kernels {

CrossEntropyResult cross_entropy(const Tensor& logits, const Tensor& targets, Tensor* losses,
                                 Tensor* dlogits, float grad_scale) {
  const char* op = "cross_entropy";
  detail::check_rows(logits, op, "logits", DType::kF32);
  const int64_t N = logits.size(0), V = logits.size(1);
  TESSERA_CHECK(V >= 1, op, ": logits ", logits.describe(), " has an empty vocabulary");
  detail::check_vector(targets, op, "targets", N, {DType::kI32});
  if (losses) detail::check_vector(*losses, op, "losses", N, {DType::kF32});
  if (dlogits) detail::check_rows(*dlogits, op, "dlogits", DType::kF32, N, V);
  const int32_t* t = targets.data<int32_t>();
  for (int64_t n = 0; n < N; ++n)
    TESSERA_CHECK(t[n] == kIgnoreIndex || (t[n] >= 0 && t[n] < V), op, ": targets[", n,
                  "] = ", t[n], " is out of range for vocab size ", V, " (ignore index is ",
                  kIgnoreIndex, ")");
  CrossEntropyResult r;
  TESSERA_KERNEL("cross_entropy", r = cpu::cross_entropy(logits, targets, losses, dlogits, grad_scale),
                 logits, targets);
  return r;
}

}  // namespace tessera::kernels
