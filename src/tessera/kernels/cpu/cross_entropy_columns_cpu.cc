// Cross-entropy over vocabulary-major logits (V, N) on the CPU. A token's logits are a
// column, so the softmax statistics are kept per token while the rows stream by. The
// vocabulary is cut into fixed blocks of kBlockRows rows (the same cut for any thread
// count, so the loss has the same bits for any thread count), one task each:
//   1. each block's maximum per token, merged;
//   2. each block writes exp(x - max) (f32 or rounded once to bf16) and sums it per token,
//      16 rows at a time (16 N floats, in L1); the sums merge in block order.
// One exp per logit; the logits are read twice and the exps written once. The caller
// applies grad_scale / sum and the target's -grad_scale (cross_entropy.h).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "tessera/base/thread_pool.h"
#include "tessera/kernels/cpu/avx512_math.h"
#include "tessera/kernels/cpu/cross_entropy_cpu.h"
#include "tessera/kernels/cpu/pointwise_common.h"
#include "tessera/tensor/bf16_avx512.h"

namespace tessera::kernels::cpu {
namespace {

namespace av = avx512;

constexpr int64_t kBlockRows = 2048;
constexpr int64_t kChunkRows = 16;

inline float value(float x) { return x; }
inline float value(bf16 x) { return bf16_to_f32(x.bits); }
TESSERA_AVX512 inline __m512 load16(const float* p, __mmask16 k) { return _mm512_maskz_loadu_ps(k, p); }
TESSERA_AVX512 inline __m512 load16(const bf16* p, __mmask16 k) { return av::load(p, k); }

// m[n] = max(m[n], rows [v0, v1) of column n).
template <typename S>
void block_max_scalar(const Rows<S>& X, int64_t v0, int64_t v1, float* m) {
  for (int64_t v = v0; v < v1; ++v)
    for (int64_t n = 0; n < X.cols; ++n) m[n] = std::max(m[n], value(X.row(v)[n]));
}

template <typename S>
TESSERA_AVX512 void block_max_avx512(const Rows<S>& X, int64_t v0, int64_t v1, float* m) {
  const int64_t N = X.cols;
  for (int64_t v = v0; v < v1; v += kChunkRows) {
    const int64_t ve = std::min(v1, v + kChunkRows);
    for (int64_t n = 0; n < N; n += 16) {
      const __mmask16 k = av::tail_mask(N - n);
      __m512 a = _mm512_maskz_loadu_ps(k, m + n), b = a;
      int64_t r = v;
      for (; r + 2 <= ve; r += 2) {
        a = _mm512_max_ps(a, load16(X.row(r) + n, k));
        b = _mm512_max_ps(b, load16(X.row(r + 1) + n, k));
      }
      if (r < ve) a = _mm512_max_ps(a, load16(X.row(r) + n, k));
      _mm512_mask_storeu_ps(m + n, k, _mm512_max_ps(a, b));
    }
  }
}

inline void put(float* p, float v) { *p = v; }
inline void put(bf16* p, float v) { p->bits = f32_to_bf16(v); }

// s[n] += sum over rows [v0, v1) of exp(x - mx[n]), each exp stored to E when given.
template <typename S, typename D>
void block_exps_scalar(const Rows<S>& X, const Rows<D>* E, int64_t v0, int64_t v1,
                       const float* mx, float* s) {
  for (int64_t v = v0; v < v1; ++v)
    for (int64_t n = 0; n < X.cols; ++n) {
      const float e = std::exp(value(X.row(v)[n]) - mx[n]);
      if (E) put(E->row(v) + n, e);
      s[n] += e;
    }
}

TESSERA_AVX512 inline void put(float* p, __m512 v, __mmask16 k) { _mm512_mask_storeu_ps(p, k, v); }
TESSERA_AVX512 inline void put(bf16* p, __m512 v, __mmask16 k) { _mm256_mask_storeu_epi16(p, k, bf16_pack(v)); }

template <typename S, typename D>
TESSERA_AVX512 void block_exps_avx512(const Rows<S>& X, const Rows<D>* E, int64_t v0,
                                      int64_t v1, const float* mx, float* s) {
  const int64_t N = X.cols;
  for (int64_t v = v0; v < v1; v += kChunkRows) {
    const int64_t ve = std::min(v1, v + kChunkRows);
    for (int64_t n = 0; n < N; n += 16) {
      const __mmask16 k = av::tail_mask(N - n);
      const __m512 m = _mm512_maskz_loadu_ps(k, mx + n);
      __m512 a = _mm512_maskz_loadu_ps(k, s + n), b = _mm512_setzero_ps();
      for (int64_t r = v; r < ve; ++r) {
        const __m512 e = av::exp(_mm512_sub_ps(load16(X.row(r) + n, k), m));
        if (E) put(E->row(r) + n, e, k);
        if ((r - v) & 1)
          b = _mm512_add_ps(b, e);
        else
          a = _mm512_add_ps(a, e);
      }
      _mm512_mask_storeu_ps(s + n, k, _mm512_add_ps(a, b));
    }
  }
}

// Runs fn(i, v0, v1) for every block, blocks spread over the threads.
template <typename Fn>
void for_blocks(int64_t V, Fn&& fn) {
  const int64_t blocks = (V + kBlockRows - 1) / kBlockRows;
  base::parallel_for(blocks, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) fn(i, i * kBlockRows, std::min(V, (i + 1) * kBlockRows));
  });
}

template <typename S, typename D>
void block_sums(const Rows<S>& X, Tensor* exps, const std::vector<float>& mx,
                std::vector<float>& bs, bool vec) {
  const int64_t N = X.cols;
  Rows<D> E;
  if (exps) E = rows_of<D>(*exps);
  const Rows<D>* e = exps ? &E : nullptr;
  for_blocks(X.rows, [&](int64_t i, int64_t v0, int64_t v1) {
    if (vec)
      block_exps_avx512<S, D>(X, e, v0, v1, mx.data(), &bs[i * N]);
    else
      block_exps_scalar<S, D>(X, e, v0, v1, mx.data(), &bs[i * N]);
  });
}

template <typename S>
CrossEntropyResult columns(const Tensor& logits_t, const Tensor& targets, float grad_scale,
                           Tensor* exps_t, Tensor* col_scale) {
  const auto X = rows_of<S>(logits_t);
  const int64_t V = X.rows, N = X.cols;
  const int32_t* t = targets.data<int32_t>();
  const int64_t blocks = (V + kBlockRows - 1) / kBlockRows;
  const bool vec = use_avx512();
  const float lowest = -std::numeric_limits<float>::infinity();
  std::vector<float> bm(blocks * N, lowest);
  for_blocks(V, [&](int64_t i, int64_t v0, int64_t v1) {
    if (vec)
      block_max_avx512(X, v0, v1, &bm[i * N]);
    else
      block_max_scalar(X, v0, v1, &bm[i * N]);
  });
  // Ignored tokens get a maximum that sends every exp to 0. Their target logits are read
  // now: exps_t may alias logits_t.
  std::vector<float> mx(N, std::numeric_limits<float>::max()), xt(N, 0.f);
  for (int64_t n = 0; n < N; ++n) {
    if (t[n] == kIgnoreIndex) continue;
    float m = lowest;
    for (int64_t i = 0; i < blocks; ++i) m = std::max(m, bm[i * N + n]);
    mx[n] = m;
    xt[n] = value(X.row(t[n])[n]);
  }
  std::vector<float> bs(blocks * N, 0.f);
  if (exps_t && exps_t->dtype() == DType::kBF16)
    block_sums<S, bf16>(X, exps_t, mx, bs, vec);
  else
    block_sums<S, float>(X, exps_t, mx, bs, vec);
  // Per token the loss log(sum) - (x_target - max), as torch's log_softmax, summed in
  // token order in double.
  CrossEntropyResult r;
  float* k = col_scale ? col_scale->data<float>() : nullptr;
  for (int64_t n = 0; n < N; ++n) {
    if (k) k[n] = 0.f;
    if (t[n] == kIgnoreIndex) continue;
    double sum = 0;
    for (int64_t i = 0; i < blocks; ++i) sum += bs[i * N + n];
    if (k) k[n] = grad_scale / static_cast<float>(sum);
    r.loss_sum += std::log(static_cast<float>(sum)) - (xt[n] - mx[n]);
    ++r.count;
  }
  return r;
}

}  // namespace

CrossEntropyResult cross_entropy_columns(const Tensor& logits_t, const Tensor& targets,
                                         float grad_scale, Tensor* exps_t, Tensor* col_scale) {
  return logits_t.dtype() == DType::kBF16 ? columns<bf16>(logits_t, targets, grad_scale, exps_t, col_scale)
                                          : columns<float>(logits_t, targets, grad_scale, exps_t, col_scale);
}

}  // namespace tessera::kernels::cpu
