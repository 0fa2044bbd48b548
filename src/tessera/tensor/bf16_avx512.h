// f32 -> bf16 for 16 lanes at a time (AVX-512F): the one vector form of f32_to_bf16
// (dtype.h), used by the tensor conversions and by the kernels that write bf16. Call only
// from functions compiled for AVX-512 (after checking the CPU has it).
#pragma once
#include <immintrin.h>

namespace tessera {

// v rounded to bf16, as f32 bits (the low half zero): round to nearest even, a NaN kept a
// quiet NaN, as f32_to_bf16 does.
__attribute__((target("avx512f"))) inline __m512i bf16_round_bits(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_and_si512(_mm512_mask_mov_epi32(r, nan, _mm512_or_si512(u, _mm512_set1_epi32(0x400000))),
                          _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
}

// The 16 bf16 values of v (f32_to_bf16 of each lane).
__attribute__((target("avx512f"))) inline __m256i bf16_pack(__m512 v) {
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_round_bits(v), 16));
}

// bf16 pairs (a, b) of 16 lanes as 32-bit words, a's bf16 in the low half (the lower
// address) and b's in the high half: two rows interleaved as AMX's VNNI operands take them.
__attribute__((target("avx512f"))) inline __m512i bf16_pair_words(__m512 a, __m512 b) {
  return _mm512_or_si512(_mm512_srli_epi32(bf16_round_bits(a), 16), bf16_round_bits(b));
}

}  // namespace tessera
