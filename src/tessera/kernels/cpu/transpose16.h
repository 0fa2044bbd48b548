// An in-register transpose of a 16 x 16 block of 32-bit values (AVX-512F): r[i] holds row
// i before, column i after. Call only from code compiled for AVX-512 on a CPU that has it.
#pragma once
#include <immintrin.h>

namespace tessera::kernels::cpu {

__attribute__((target("avx512f"))) inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  // After this, lane L of r[4g + c] holds column 4L + c of rows 4g .. 4g + 3.
  for (int g = 0; g < 4; ++g) {
    const __m512d t0 = _mm512_castps_pd(t[4 * g]), t1 = _mm512_castps_pd(t[4 * g + 1]);
    const __m512d t2 = _mm512_castps_pd(t[4 * g + 2]), t3 = _mm512_castps_pd(t[4 * g + 3]);
    r[4 * g] = _mm512_castpd_ps(_mm512_unpacklo_pd(t0, t2));
    r[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(t0, t2));
    r[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(t1, t3));
    r[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(t1, t3));
  }
  for (int c = 0; c < 4; ++c)
    t[c] = r[c], t[4 + c] = r[4 + c], t[8 + c] = r[8 + c], t[12 + c] = r[12 + c];
  for (int c = 0; c < 4; ++c) {
    const __m512 ab_lo = _mm512_shuffle_f32x4(t[c], t[4 + c], 0x44);
    const __m512 ab_hi = _mm512_shuffle_f32x4(t[c], t[4 + c], 0xEE);
    const __m512 cd_lo = _mm512_shuffle_f32x4(t[8 + c], t[12 + c], 0x44);
    const __m512 cd_hi = _mm512_shuffle_f32x4(t[8 + c], t[12 + c], 0xEE);
    r[c] = _mm512_shuffle_f32x4(ab_lo, cd_lo, 0x88);
    r[4 + c] = _mm512_shuffle_f32x4(ab_lo, cd_lo, 0xDD);
    r[8 + c] = _mm512_shuffle_f32x4(ab_hi, cd_hi, 0x88);
    r[12 + c] = _mm512_shuffle_f32x4(ab_hi, cd_hi, 0xDD);
  }
}

}  // namespace tessera::kernels::cpu
