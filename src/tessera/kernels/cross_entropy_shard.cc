// Vocab-parallel cross-entropy steps (cross_entropy.h). Plain loops: the exp per logit is
// the cost, N x V / tp of them, next to the (N, H) x (H, V / tp) head GEMM that made them.
#include <cmath>
#include <limits>

#include "tessera/base/thread_pool.h"
#include "tessera/kernels/cross_entropy.h"
#include "tessera/kernels/pointwise_checks.h"

namespace tessera::kernels {
namespace {

// The shapes steps 2 and 3 share: logits (N, Vr), max (N), targets (N), sums (2N).
void check_shard_step(const char* op, const Tensor& logits, const Tensor& max,
                      const Tensor& targets, const Tensor& sums) {
  detail::check_rows(logits, op, "logits", DType::kF32);
  const int64_t N = logits.size(0);
  detail::check_vector(max, op, "max", N, {DType::kF32});
  detail::check_vector(targets, op, "targets", N, {DType::kI32});
  detail::check_vector(sums, op, "sums", 2 * N, {DType::kF32});
}

}  // namespace

void shard_row_max(const Tensor& logits, Tensor& max) {
  detail::check_rows(logits, "shard_row_max", "logits", DType::kF32);
  const int64_t N = logits.size(0), V = logits.size(1);
  detail::check_vector(max, "shard_row_max", "max", N, {DType::kF32});
  const float* L = logits.data<float>();
  const int64_t ld = logits.stride(0);
  float* M = max.data<float>();
  base::parallel_for(N, 1, [&](int64_t b, int64_t e) {
    for (int64_t n = b; n < e; ++n) {
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < V; ++j) m = std::max(m, L[n * ld + j]);
      M[n] = m;
    }
  });
}

void shard_softmax_sums(const Tensor& logits, const Tensor& max, const Tensor& targets,
                        int64_t begin, int64_t vocab, Tensor& sums) {
  const char* op = "shard_softmax_sums";
  check_shard_step(op, logits, max, targets, sums);
  const int64_t N = logits.size(0), V = logits.size(1);
  const int32_t* tc = targets.data<int32_t>();
  for (int64_t n = 0; n < N; ++n)  // against the whole vocabulary, before any thread starts
    TESSERA_CHECK(tc[n] == kIgnoreIndex || (tc[n] >= 0 && tc[n] < vocab), "cross_entropy: targets[",
                  n, "] = ", tc[n], " is out of range for vocab size ", vocab, " (ignore index is ",
                  kIgnoreIndex, ")");
  const float* L = logits.data<float>();
  const int64_t ld = logits.stride(0);
  const float* M = max.data<float>();
  const int32_t* t = targets.data<int32_t>();
  float* S = sums.data<float>();
  base::parallel_for(N, 1, [&](int64_t b, int64_t e) {
    for (int64_t n = b; n < e; ++n) {
      double s = 0.0;
      for (int64_t j = 0; j < V; ++j) s += std::exp(L[n * ld + j] - M[n]);
      S[n] = static_cast<float>(s);
      const int64_t local = static_cast<int64_t>(t[n]) - begin;
      S[N + n] = t[n] != kIgnoreIndex && local >= 0 && local < V ? L[n * ld + local] : 0.f;
    }
  });
}

CrossEntropyResult shard_cross_entropy(const Tensor& logits, const Tensor& targets,
                                       int64_t begin, const Tensor& max, const Tensor& sums,
                                       Tensor* dlogits, float grad_scale) {
  const char* op = "shard_cross_entropy";
  check_shard_step(op, logits, max, targets, sums);
  const int64_t N = logits.size(0), V = logits.size(1);
  if (dlogits) detail::check_rows(*dlogits, op, "dlogits", DType::kF32, N, V);
  const float* L = logits.data<float>();
  const int64_t ld = logits.stride(0);
  const float* M = max.data<float>();
  const float* S = sums.data<float>();
  const int32_t* t = targets.data<int32_t>();
  CrossEntropyResult r;
  for (int64_t n = 0; n < N; ++n) {
    if (t[n] == kIgnoreIndex) continue;
    r.loss_sum += std::log(static_cast<double>(S[n])) + M[n] - S[N + n];
    ++r.count;
  }
  if (!dlogits) return r;
  float* D = dlogits->data<float>();
  const int64_t dd = dlogits->stride(0);
  base::parallel_for(N, 1, [&](int64_t b, int64_t e) {
    for (int64_t n = b; n < e; ++n) {
      float* row = D + n * dd;
      const float* in = L + n * ld;
      if (t[n] == kIgnoreIndex) {
        for (int64_t j = 0; j < V; ++j) row[j] = 0.f;
        continue;
      }
      const float inv = grad_scale / S[n];
      for (int64_t j = 0; j < V; ++j) row[j] = std::exp(in[j] - M[n]) * inv;
      const int64_t local = static_cast<int64_t>(t[n]) - begin;
      if (local >= 0 && local < V) row[local] -= grad_scale;
    }
  });
  return r;
}

}  // namespace tessera::kernels
