// Fused softmax + cross-entropy on the CPU, one row per task. Per row: max, then
// exp(x - max) summed (and stored into dlogits when a gradient is wanted), then the
// stored exps scaled by grad_scale / sum. The row (V * 4 bytes, ~200 KB for GPT-2)
// stays in L2 between passes. dlogits may alias logits: logit[target] is read first,
// and every pass reads element i before writing it.
#include "tessera/kernels/cpu/cross_entropy_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "tessera/base/thread_pool.h"
#include "tessera/kernels/cpu/avx512_math.h"
#include "tessera/kernels/cpu/pointwise_common.h"

namespace tessera::kernels::cpu {
namespace {

namespace av = avx512;

// Returns -log softmax(x)[target]; writes grad_scale * (softmax(x) - onehot) to d if given.
float ce_row_scalar(const float* x, int64_t V, int32_t target, float* d, float scale) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < V; ++i) mx = std::max(mx, x[i]);
  const float xt = x[target];
  double sum = 0;
  for (int64_t i = 0; i < V; ++i) {
    const float e = std::exp(x[i] - mx);
    if (d) d[i] = e;
    sum += e;
  }
  if (d) {
    const float k = scale / static_cast<float>(sum);
    for (int64_t i = 0; i < V; ++i) d[i] *= k;
    d[target] -= scale;
  }
  // torch's log_softmax: (x - max) - log(sum), negated at the target.
  return std::log(static_cast<float>(sum)) - (xt - mx);
}

TESSERA_AVX512 float ce_row_avx512(const float* x, int64_t V, int32_t target, float* d,
                                   float scale) {
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 m0 = ninf, m1 = ninf;
  int64_t i = 0;
  for (; i + 32 <= V; i += 32) {
    m0 = _mm512_max_ps(m0, av::load(x + i));
    m1 = _mm512_max_ps(m1, av::load(x + i + 16));
  }
  for (; i < V; i += 16)
    m0 = _mm512_max_ps(m0, _mm512_mask_loadu_ps(ninf, av::tail_mask(V - i), x + i));
  const float mxs = _mm512_reduce_max_ps(_mm512_max_ps(m0, m1));
  const __m512 mx = _mm512_set1_ps(mxs);
  const float xt = x[target];

  // Four independent sums: they hide the add latency and keep each f32 sum short.
  __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  for (i = 0; i + 64 <= V; i += 64) {
    const __m512 e0 = av::exp(_mm512_sub_ps(av::load(x + i), mx));
    const __m512 e1 = av::exp(_mm512_sub_ps(av::load(x + i + 16), mx));
    const __m512 e2 = av::exp(_mm512_sub_ps(av::load(x + i + 32), mx));
    const __m512 e3 = av::exp(_mm512_sub_ps(av::load(x + i + 48), mx));
    if (d) {
      av::store(d + i, e0);
      av::store(d + i + 16, e1);
      av::store(d + i + 32, e2);
      av::store(d + i + 48, e3);
    }
    s0 = _mm512_add_ps(s0, e0);
    s1 = _mm512_add_ps(s1, e1);
    s2 = _mm512_add_ps(s2, e2);
    s3 = _mm512_add_ps(s3, e3);
  }
  for (; i < V; i += 16) {
    const __mmask16 m = av::tail_mask(V - i);
    const __m512 e = av::exp(_mm512_sub_ps(av::load(x + i, m), mx));
    if (d) av::store(d + i, e, m);
    s0 = _mm512_mask_add_ps(s0, m, s0, e);
  }
  const float sum =
      _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
  if (d) {
    const __m512 k = _mm512_set1_ps(scale / sum);
    for (i = 0; i < V; i += 16) {
      const __mmask16 m = av::tail_mask(V - i);
      av::store(d + i, _mm512_mul_ps(av::load(d + i, m), k), m);
    }
    d[target] -= scale;
  }
  return std::log(sum) - (xt - mxs);
}

}  // namespace

CrossEntropyResult cross_entropy(const Tensor& logits, const Tensor& targets, Tensor* losses,
                                 Tensor* dlogits, float grad_scale) {
  const auto X = rows_of<float>(logits);
  Rows<float> D;
  if (dlogits) D = rows_of<float>(*dlogits);
  const int32_t* t = targets.data<int32_t>();
  const int64_t N = X.rows, V = X.cols;
  std::vector<float> row_loss(N, 0.f);
  const bool vec = use_avx512();
  base::parallel_for(N, grain_rows(V, int64_t{1} << 13), [&](int64_t b, int64_t e) {
    for (int64_t n = b; n < e; ++n) {
      float* d = dlogits ? D.row(n) : nullptr;
      if (t[n] == kIgnoreIndex) {
        if (d) std::memset(d, 0, V * sizeof(float));
        continue;
      }
      row_loss[n] = vec ? ce_row_avx512(X.row(n), V, t[n], d, grad_scale)
                        : ce_row_scalar(X.row(n), V, t[n], d, grad_scale);
    }
  });
  // Summed serially in row order in double: the same bits for any thread count.
  CrossEntropyResult r;
  for (int64_t n = 0; n < N; ++n) {
    if (t[n] == kIgnoreIndex) continue;
    r.loss_sum += row_loss[n];
    ++r.count;
  }
  if (losses) std::memcpy(losses->data<float>(), row_loss.data(), N * sizeof(float));
  return r;
}

}  // namespace tessera::kernels::cpu
