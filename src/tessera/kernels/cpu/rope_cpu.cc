// Rotary embedding on the CPU: per row, the cos/sin table for that row's position is
// computed once (f32 angle, as Hugging Face computes it) and applied to every head.
#include "tessera/kernels/cpu/rope_cpu.h"

#include <cmath>
#include <vector>

#include "tessera/base/thread_pool.h"
#include "tessera/kernels/cpu/avx512_math.h"
#include "tessera/kernels/cpu/pointwise_common.h"

namespace tessera::kernels::cpu {
namespace {

namespace av = avx512;

// One head (2 * half floats): out[i] = x[i] cos - x[i + half] sin,
// out[i + half] = x[i + half] cos + x[i] sin.
void rotate_scalar(float* x, const float* c, const float* s, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[i + half];
    x[i] = x1 * c[i] - x2 * s[i];
    x[i + half] = x2 * c[i] + x1 * s[i];
  }
}

TESSERA_AVX512 void rotate_avx512(float* x, const float* c, const float* s, int64_t half) {
  for (int64_t i = 0; i < half; i += 16) {
    const __mmask16 m = av::tail_mask(half - i);
    const __m512 x1 = av::load(x + i, m), x2 = av::load(x + half + i, m);
    const __m512 cv = av::load(c + i, m), sv = av::load(s + i, m);
    av::store(x + i, _mm512_fnmadd_ps(x2, sv, _mm512_mul_ps(x1, cv)), m);
    av::store(x + half + i, _mm512_fmadd_ps(x1, sv, _mm512_mul_ps(x2, cv)), m);
  }
}

}  // namespace

void rope_apply(Tensor& x, int64_t head_dim, const Tensor& positions, const RopeFreqs& freqs,
                bool inverse) {
  const auto X = rows_of<float>(x);
  const int64_t half = freqs.rotary_dim() / 2, heads = X.cols / head_dim;
  const float* inv_freq = freqs.inv_freq.data();
  const float af = freqs.attention_factor;
  const int32_t* pos = positions.data<int32_t>();
  const bool vec = use_avx512();
  base::parallel_for(X.rows, grain_rows(X.cols), [&](int64_t b, int64_t e) {
    std::vector<float> table(2 * half);
    float* c = table.data();
    float* s = c + half;
    for (int64_t n = b; n < e; ++n) {
      const float p = static_cast<float>(pos[n]);
      for (int64_t i = 0; i < half; ++i) {
        // f32 angle as HF's (inv_freq @ position_ids).float(); cos and sin then times the
        // attention factor (f32, as HF's cos * attention_scaling); the transpose rotation
        // (inverse) only flips the sign of sin.
        ::sincosf(p * inv_freq[i], &s[i], &c[i]);
        if (af != 1.f) c[i] *= af, s[i] *= af;
        if (inverse) s[i] = -s[i];
      }
      float* row = X.row(n);
      for (int64_t h = 0; h < heads; ++h) {
        if (vec)
          rotate_avx512(row + h * head_dim, c, s, half);
        else
          rotate_scalar(row + h * head_dim, c, s, half);
      }
    }
  });
}

}  // namespace tessera::kernels::cpu
