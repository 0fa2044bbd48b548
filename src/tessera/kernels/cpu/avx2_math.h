// AVX2 building blocks shared by the CPU kernels (skinny GEMM, quantized GEMV, attention
// tiles). Call them only from functions whose target includes avx2 and fma.
#pragma once
#include <immintrin.h>

#include <cstdint>

#define TESSERA_AVX2_FMA __attribute__((target("avx2,fma")))

namespace tessera::kernels::cpu::avx2 {

// The sum of the 8 lanes.
__attribute__((target("avx2"))) inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The largest of the 8 lanes.
__attribute__((target("avx2"))) inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Lanes [0, n) of an 8-lane vector set (all of them when n >= 8), for vmaskmovps.
__attribute__((target("avx2"))) inline __m256i tail_mask(int64_t n) {
  const int k = n >= 8 ? 8 : static_cast<int>(n);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(k), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// exp(x) by avx512::exp's reduction and polynomial (Cephes expf: x = n ln2 + r, |r| <= ln2/2,
// e^r by a degree-7 polynomial), 2^n built in the exponent bits as two halves so n up to 128
// does not overflow them. x < -87.3 (including -inf: a masked attention score), and NaN,
// give exactly 0, so no denormals reach the products that follow; x is capped at 88.7.
TESSERA_AVX2_FMA inline __m256 exp_or_zero(__m256 x) {
  const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_GE_OQ);
  x = _mm256_min_ps(x, _mm256_set1_ps(88.7f));
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  // 2^n = 2^h 2^(n - h), h = n >> 1: each factor's exponent stays in [-63, 64].
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i h = _mm256_srai_epi32(ni, 1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(h, bias), 23));
  const __m256 f2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, h), bias), 23));
  return _mm256_and_ps(_mm256_mul_ps(_mm256_mul_ps(y, f1), f2), keep);
}

}  // namespace tessera::kernels::cpu::avx2
