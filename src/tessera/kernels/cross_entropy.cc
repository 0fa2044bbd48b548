// Entry point of cross_entropy.h: shape checks, and every target validated before any
// thread starts (an exception must not escape an OpenMP region).
#include "tessera/kernels/cross_entropy.h"

#include <algorithm>
#include <cmath>

#include "tessera/kernels/dispatch.h"

#include "tessera/kernels/cpu/cross_entropy_cpu.h"
#include "tessera/kernels/pointwise_checks.h"

namespace tessera::kernels {
namespace {

// Every target in [0, V) or the ignore index.
void check_targets(const char* op, const Tensor& targets, int64_t N, int64_t V) {
  const int32_t* t = targets.data<int32_t>();
  for (int64_t n = 0; n < N; ++n)
    TESSERA_CHECK(t[n] == kIgnoreIndex || (t[n] >= 0 && t[n] < V), op, ": targets[", n,
                  "] = ", t[n], " is out of range for vocab size ", V, " (ignore index is ",
                  kIgnoreIndex, ")");
}

}  // namespace

double log_sum_exp(const float* x, int64_t n) {
  double m = -INFINITY;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, static_cast<double>(x[i]));
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) sum += std::exp(static_cast<double>(x[i]) - m);
  return m + std::log(sum);
}

CrossEntropyResult cross_entropy(const Tensor& logits, const Tensor& targets, Tensor* losses,
                                 Tensor* dlogits, float grad_scale) {
  const char* op = "cross_entropy";
  detail::check_rows(logits, op, "logits", DType::kF32);
  const int64_t N = logits.size(0), V = logits.size(1);
  TESSERA_CHECK(V >= 1, op, ": logits ", logits.describe(), " has an empty vocabulary");
  detail::check_vector(targets, op, "targets", N, {DType::kI32});
  if (losses) detail::check_vector(*losses, op, "losses", N, {DType::kF32});
  if (dlogits) detail::check_rows(*dlogits, op, "dlogits", DType::kF32, N, V);
  check_targets(op, targets, N, V);
  CrossEntropyResult r;
  TESSERA_KERNEL("cross_entropy", r = cpu::cross_entropy(logits, targets, losses, dlogits, grad_scale),
                 logits, targets);
  return r;
}

CrossEntropyResult cross_entropy_columns(const Tensor& logits_t, const Tensor& targets,
                                         float grad_scale, Tensor* exps_t, Tensor* col_scale) {
  const char* op = "cross_entropy_columns";
  TESSERA_CHECK(logits_t.dtype() == DType::kF32 || logits_t.dtype() == DType::kBF16, op,
                ": logits_t ", logits_t.describe(), " must be f32 or bf16");
  detail::check_rows(logits_t, op, "logits_t", logits_t.dtype());
  const int64_t V = logits_t.size(0), N = logits_t.size(1);
  TESSERA_CHECK(V >= 1, op, ": logits_t ", logits_t.describe(), " has an empty vocabulary");
  detail::check_vector(targets, op, "targets", N, {DType::kI32});
  TESSERA_CHECK(!exps_t == !col_scale, op, ": exps_t and col_scale go together");
  if (exps_t) {
    TESSERA_CHECK(exps_t->dtype() == DType::kF32 || exps_t->dtype() == DType::kBF16, op,
                  ": exps_t ", exps_t->describe(), " must be f32 or bf16");
    detail::check_rows(*exps_t, op, "exps_t", exps_t->dtype(), V, N);
    detail::check_vector(*col_scale, op, "col_scale", N, {DType::kF32});
  }
  check_targets(op, targets, N, V);
  CrossEntropyResult r;
  TESSERA_KERNEL("cross_entropy",
                 r = cpu::cross_entropy_columns(logits_t, targets, grad_scale, exps_t, col_scale),
                 logits_t, targets);
  return r;
}

}  // namespace tessera::kernels
