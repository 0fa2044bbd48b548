// AVX-512 building blocks of the pointwise kernels: exp, sigmoid, tail masks and
// f32 / bf16 loads. Every function carries the AVX-512 target attribute, so call them
// only from functions marked TESSERA_AVX512, after checking cpu::use_avx512().
#pragma once
#include <immintrin.h>

#include <cstdint>

#include "tessera/tensor/dtype.h"

// GCC 12 warns about the deliberately undefined pass-through operand inside its own
// AVX-512 intrinsics (_mm512_undefined_*; GCC bug 105593) at every inlining site.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#define TESSERA_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))

namespace tessera::kernels::cpu::avx512 {

// Lanes [0, n) of a 16-lane vector (all of them when n >= 16).
TESSERA_AVX512 inline __mmask16 tail_mask(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << n) - 1u);
}

TESSERA_AVX512 inline __m512 load(const float* p) { return _mm512_loadu_ps(p); }
TESSERA_AVX512 inline __m512 load(const float* p, __mmask16 m) {
  return _mm512_maskz_loadu_ps(m, p);
}
// 16 fp8 e4m3 codes as f32 values divided by 256, exactly: s.eeee.mmm placed in an f16 as
// s.0eeee.mmm0000000 (subnormals included; vcvtph2ps widens them whatever the DAZ flag).
// Code 0x7F (0xFF) comes out as 480 / 256, not NaN: callers that can meet it mask it.
TESSERA_AVX512 inline __m512 e4m3_over_256(const uint8_t* p) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i m7f = _mm256_set1_epi16(0x7F), m80 = _mm256_set1_epi16(0x80);
  return _mm512_cvtph_ps(_mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, m7f), 7),
                                         _mm256_slli_epi16(_mm256_and_si256(b, m80), 8)));
}
// bf16 -> f32 is exact: the 16 bits become the high half of the float.
TESSERA_AVX512 inline __m512 load(const bf16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
TESSERA_AVX512 inline __m512 load(const bf16* p, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
TESSERA_AVX512 inline void store(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
TESSERA_AVX512 inline void store(float* p, __m512 v, __mmask16 m) {
  _mm512_mask_storeu_ps(p, m, v);
}

// e^x with Cephes expf's reduction and polynomial: x = n ln2 + r, |r| <= ln2/2, e^r by
// a degree-7 polynomial, 2^n by scalef (which also gives exact denormals / 0 below and
// inf above). Checked exhaustively over all floats in [-87, 88]: max relative error
// 8.5e-8 (1.01 ulp) against the correctly rounded value. NaN propagates.
TESSERA_AVX512 inline __m512 exp(__m512 x) {
  // min/max return their second operand when one is NaN: keep x second.
  x = _mm512_min_ps(_mm512_set1_ps(89.0f), x);
  x = _mm512_max_ps(_mm512_set1_ps(-104.0f), x);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // ln2 split in two so n * ln2_hi is exact (ln2_hi has 9 significant bits).
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 r2 = _mm512_mul_ps(r, r);
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, r2, r), _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(y, n);
}

// exp(x), with x < -87.3 (including -inf: a masked attention score) exactly 0, so no
// denormals reach the products that follow.
TESSERA_AVX512 inline __m512 exp_or_zero(__m512 x) {
  const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_GE_OQ);
  return _mm512_maskz_mov_ps(keep, exp(x));
}

// 1 / (1 + e^-x), as torch computes sigmoid; saturates to 0 / 1 without NaN.
TESSERA_AVX512 inline __m512 sigmoid(__m512 x) {
  const __m512 one = _mm512_set1_ps(1.0f);
  return _mm512_div_ps(one, _mm512_add_ps(one, exp(_mm512_sub_ps(_mm512_setzero_ps(), x))));
}

}  // namespace tessera::kernels::cpu::avx512
