// AVX2 building blocks shared by the CPU kernels (skinny GEMM, quantized GEMV). Call
// them only from functions whose target includes avx2.
#pragma once
#include <immintrin.h>

namespace tessera::kernels::cpu::avx2 {

// The sum of the 8 lanes.
__attribute__((target("avx2"))) inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

}  // namespace tessera::kernels::cpu::avx2
