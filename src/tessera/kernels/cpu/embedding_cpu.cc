// Embedding lookup and its gradient on the CPU. The backward splits the hidden dim
// across threads (in 16-float, cache-line-sized column blocks): every thread walks all
// tokens in order, so repeated ids never race and the sum order is fixed.
#include "tessera/kernels/cpu/embedding_cpu.h"

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "tessera/base/thread_pool.h"
#include "tessera/kernels/cpu/avx512_math.h"
#include "tessera/kernels/cpu/pointwise_common.h"

namespace tessera::kernels::cpu {
namespace {

namespace av = avx512;

// dst[i] (+)= src[i] for i < n; S is float or bf16.
template <typename S>
void copy_row_scalar(float* dst, const S* src, int64_t n, bool accumulate) {
  if (accumulate) {
    for (int64_t i = 0; i < n; ++i) dst[i] += to_f32(src[i]);
  } else if constexpr (std::is_same_v<S, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = to_f32(src[i]);
  }
}

template <typename S>
TESSERA_AVX512 void copy_row_avx512(float* dst, const S* src, int64_t n, bool accumulate) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = av::tail_mask(n - i);
    __m512 v = av::load(src + i, m);
    if (accumulate) v = _mm512_add_ps(v, av::load(dst + i, m));
    av::store(dst + i, v, m);
  }
}

constexpr int64_t kColBlock = 16;  // one cache line of f32: no false sharing between threads

}  // namespace

void embedding_forward(const Tensor& weight, const Tensor& ids, Tensor& out, bool accumulate) {
  const auto O = rows_of<float>(out);
  const int32_t* id = ids.data<int32_t>();
  const int64_t wpitch = weight.stride(0), H = O.cols;
  const bool vec = use_avx512();
  with_param_type(weight, [&](const auto* w) {
    base::parallel_for(O.rows, grain_rows(H), [&](int64_t b, int64_t e) {
      for (int64_t n = b; n < e; ++n) {
        const auto* src = w + static_cast<int64_t>(id[n]) * wpitch;
        if (vec)
          copy_row_avx512(O.row(n), src, H, accumulate);
        else
          copy_row_scalar(O.row(n), src, H, accumulate);
      }
    });
  });
}

void embedding_backward(const Tensor& dout, const Tensor& ids, Tensor& dweight) {
  const auto D = rows_of<const float>(dout);
  const auto W = rows_of<float>(dweight);
  const int32_t* id = ids.data<int32_t>();
  const int64_t blocks = (D.cols + kColBlock - 1) / kColBlock;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(1, D.rows * kColBlock));
  const bool vec = use_avx512();
  base::parallel_for(blocks, grain, [&](int64_t b0, int64_t b1) {
    const int64_t c0 = b0 * kColBlock, c1 = std::min(D.cols, b1 * kColBlock);
    for (int64_t n = 0; n < D.rows; ++n) {
      float* dst = W.row(id[n]) + c0;
      if (vec)
        copy_row_avx512(dst, D.row(n) + c0, c1 - c0, /*accumulate=*/true);
      else
        copy_row_scalar(dst, D.row(n) + c0, c1 - c0, /*accumulate=*/true);
    }
  });
}

}  // namespace tessera::kernels::cpu
