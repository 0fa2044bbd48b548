// The quantized GEMV's AVX-512 row kernels. Float schemes: each 32-weight run is widened to
// f32 sixteen codes per register and FMA'd against f32 activations, four output rows at
// a time for one row of x so the activations are loaded once for the four; the group's
// scale multiplies its partial sums and the zero point comes off as s z sum(x_group)
// (quant_cpu.cc's prepare). W8A8: |x| as u8 times the weight with x's sign, into exact
// int32 sums (vpdpbusd with VNNI, vpmaddubsw + vpmaddwd without).
// GCC 12 warns about its own _mm512_undefined_* placeholders (GCC PR 105593).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <algorithm>

#include "tessera/kernels/cpu/quant_rows.h"

#define TESSERA_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma,f16c")))
#define TESSERA_TARGET_AVX512_VNNI \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

namespace tessera::kernels::cpu {
namespace {

// The 32 stored weights of a run starting at byte `p`, widened to f32 before the scale:
// v0 = weights 0..15, v1 = 16..31. fp8 comes out 2^-8 times too small (e4m3 bits placed in
// an f16's); the caller multiplies the scale by 256.
template <QuantScheme S>
TESSERA_TARGET_AVX512 inline void unpack32(const uint8_t* p, __m512& v0, __m512& v1) {
  if constexpr (S == QuantScheme::kInt8) {
    v0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    v1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
  } else if constexpr (S == QuantScheme::kInt4) {
    // 16 bytes: byte j holds weight j (low nibble) and weight j + 16 (high nibble).
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i mask = _mm_set1_epi8(0x0F);
    v0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, mask)));
    v1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), mask)));
  } else {  // kFp8: e4m3 s.eeee.mmm -> f16 s.0eeee.mmm0000000 (value / 256, exact)
    const __m256i m7f = _mm256_set1_epi16(0x7F), m80 = _mm256_set1_epi16(0x80);
    __m512* out[2] = {&v0, &v1};
    for (int h = 0; h < 2; ++h) {
      const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * h)));
      const __m256i f16 = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, m7f), 7),
                                          _mm256_slli_epi16(_mm256_and_si256(b, m80), 8));
      *out[h] = _mm512_cvtph_ps(f16);
    }
  }
}

// NR output rows against MB rows of x; two accumulators per (row, x row) inside a group,
// folded into the running total with the group's scale at the group's end.
template <QuantScheme S, int MB, int NR>
TESSERA_TARGET_AVX512 void block(const QuantWeight& w, const Activations& a, int64_t m0, float* y,
                                 int64_t ldy, int64_t o) {
  const int64_t G = w.groups(), rb = row_bytes(w), gs = w.group;
  const int64_t per_byte = S == QuantScheme::kInt4 ? 2 : 1;
  const uint8_t* rows[NR];
  for (int r = 0; r < NR; ++r) rows[r] = w.q.data<uint8_t>() + (o + r) * rb;
  const float* sc = w.scales.data<float>() + o * G;
  const float* zp = w.zeros.defined() ? w.zeros.data<float>() + o * G : nullptr;
  const float unit = S == QuantScheme::kFp8 ? 256.f : 1.f;
  const float* xs[MB];
  for (int m = 0; m < MB; ++m) xs[m] = a.x + (m0 + m) * a.ld;
  __m512 total[NR][MB];
  float corr[NR][MB] = {};
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MB; ++m) total[r][m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512 acc[NR][MB][2];
    for (int r = 0; r < NR; ++r)
      for (int m = 0; m < MB; ++m) acc[r][m][0] = acc[r][m][1] = _mm512_setzero_ps();
    const int64_t j0 = g * gs, j1 = j0 + gs;
    int64_t j = j0;
    for (; j + 32 <= j1; j += 32) {
      __m512 xv[MB][2];
      for (int m = 0; m < MB; ++m) {
        xv[m][0] = _mm512_loadu_ps(xs[m] + j);
        xv[m][1] = _mm512_loadu_ps(xs[m] + j + 16);
      }
      for (int r = 0; r < NR; ++r) {
        const uint8_t* p = rows[r] + j / per_byte;
        _mm_prefetch(reinterpret_cast<const char*>(p + 1024), _MM_HINT_T0);
        __m512 v0, v1;
        unpack32<S>(p, v0, v1);
        for (int m = 0; m < MB; ++m) {
          acc[r][m][0] = _mm512_fmadd_ps(xv[m][0], v0, acc[r][m][0]);
          acc[r][m][1] = _mm512_fmadd_ps(xv[m][1], v1, acc[r][m][1]);
        }
      }
    }
    for (int r = 0; r < NR; ++r) {
      const float s = sc[r * G + g];
      const __m512 sv = _mm512_set1_ps(s * unit);
      for (int m = 0; m < MB; ++m) {
        total[r][m] = _mm512_fmadd_ps(_mm512_add_ps(acc[r][m][0], acc[r][m][1]), sv, total[r][m]);
        if (j < j1) {  // a group that is not a multiple of 32 (int8 / fp8 only)
          float t = 0.f;
          for (int64_t jj = j; jj < j1; ++jj) t += xs[m][jj] * unscaled(S, rows[r], jj);
          corr[r][m] -= s * t;
        }
        if (zp) corr[r][m] += s * zp[r * G + g] * a.xsum[(m0 + m) * G + g];
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MB; ++m) y[(m0 + m) * ldy + o + r] = _mm512_reduce_add_ps(total[r][m]) - corr[r][m];
}

template <QuantScheme S, int MB>
void rows_mb(const QuantWeight& w, const Activations& a, int64_t m0, float* y, int64_t ldy,
             int64_t o0, int64_t o1) {
  constexpr int NR = MB == 1 ? 4 : MB == 2 ? 2 : 1;
  int64_t o = o0;
  for (; o + NR <= o1; o += NR) block<S, MB, NR>(w, a, m0, y, ldy, o);
  for (; o < o1; ++o) block<S, MB, 1>(w, a, m0, y, ldy, o);
}

template <QuantScheme S>
void rows_scheme(const QuantWeight& w, const Activations& a, int64_t m0, int mb, float* y,
                 int64_t ldy, int64_t o0, int64_t o1) {
  switch (mb) {
    case 1: rows_mb<S, 1>(w, a, m0, y, ldy, o0, o1); break;
    case 2: rows_mb<S, 2>(w, a, m0, y, ldy, o0, o1); break;
    case 3: rows_mb<S, 3>(w, a, m0, y, ldy, o0, o1); break;
    default: rows_mb<S, 4>(w, a, m0, y, ldy, o0, o1); break;
  }
}

// ---- W8A8 ----------------------------------------------------------------------------

// 64 products of s8 x by s8 w summed into 16 int32 lanes: |x| (u8) times w with x's sign,
// exact (|x| <= 128, |w| <= 127: a pair of products stays inside int16 for vpmaddubsw).
TESSERA_TARGET_AVX512 inline __m512i dot64(__m512i acc, __m512i xv, __m512i wv) {
  const __m512i ax = _mm512_abs_epi8(xv);
  const __m512i sw = _mm512_mask_sub_epi8(wv, _mm512_movepi8_mask(xv), _mm512_setzero_si512(), wv);
  const __m512i p16 = _mm512_maddubs_epi16(ax, sw);
  return _mm512_add_epi32(acc, _mm512_madd_epi16(p16, _mm512_set1_epi16(1)));
}
TESSERA_TARGET_AVX512_VNNI inline __m512i dot64_vnni(__m512i acc, __m512i xv, __m512i wv) {
  const __m512i ax = _mm512_abs_epi8(xv);
  const __m512i sw = _mm512_mask_sub_epi8(wv, _mm512_movepi8_mask(xv), _mm512_setzero_si512(), wv);
  return _mm512_dpbusd_epi32(acc, ax, sw);
}

// One output row at a time against MB rows of x; DOT is dot64 or dot64_vnni, and the
// function takes that one's target (a VNNI instruction never reaches a CPU without it).
#define TESSERA_ROWS_S8(NAME, TARGET, DOT)                                                   \
  template <int MB>                                                                          \
  TARGET void NAME(const QuantWeight& w, const Activations& a, int64_t m0, float* y,         \
                   int64_t ldy, int64_t o0, int64_t o1) {                                    \
    const int64_t K = w.in, K64 = K / 64 * 64;                                               \
    for (int64_t o = o0; o < o1; ++o) {                                                      \
      const int8_t* row = w.q.data<int8_t>() + o * K;                                        \
      __m512i acc[MB];                                                                       \
      for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_si512();                          \
      for (int64_t k = 0; k < K64; k += 64) {                                                \
        const __m512i wv = _mm512_loadu_si512(row + k);                                      \
        for (int m = 0; m < MB; ++m)                                                         \
          acc[m] = DOT(acc[m], _mm512_loadu_si512(a.xq.data() + (m0 + m) * K + k), wv);      \
      }                                                                                      \
      for (int m = 0; m < MB; ++m) {                                                         \
        const int8_t* xq = a.xq.data() + (m0 + m) * K;                                       \
        int32_t s = _mm512_reduce_add_epi32(acc[m]);                                         \
        for (int64_t k = K64; k < K; ++k) s += int32_t{xq[k]} * row[k];                      \
        y[(m0 + m) * ldy + o] =                                                              \
            static_cast<float>(s) * a.xscale[m0 + m] * w.scales.data<float>()[o];            \
      }                                                                                      \
    }                                                                                        \
  }
TESSERA_ROWS_S8(rows_s8_bw, TESSERA_TARGET_AVX512, dot64)
TESSERA_ROWS_S8(rows_s8_vnni, TESSERA_TARGET_AVX512_VNNI, dot64_vnni)
#undef TESSERA_ROWS_S8

template <bool VNNI>
void rows_s8_any(const QuantWeight& w, const Activations& a, int64_t m0, int mb, float* y,
                 int64_t ldy, int64_t o0, int64_t o1) {
#define TESSERA_S8_CASE(MB)                                 \
  if (VNNI)                                                  \
    rows_s8_vnni<MB>(w, a, m0, y, ldy, o0, o1);              \
  else                                                       \
    rows_s8_bw<MB>(w, a, m0, y, ldy, o0, o1);
  switch (mb) {
    case 1: TESSERA_S8_CASE(1) break;
    case 2: TESSERA_S8_CASE(2) break;
    case 3: TESSERA_S8_CASE(3) break;
    default: TESSERA_S8_CASE(4) break;
  }
#undef TESSERA_S8_CASE
}

}  // namespace

void rows_avx512(const QuantWeight& w, const Activations& a, int64_t m0, int mb, float* y,
                 int64_t ldy, int64_t o0, int64_t o1) {
  switch (w.scheme) {
    case QuantScheme::kInt8: rows_scheme<QuantScheme::kInt8>(w, a, m0, mb, y, ldy, o0, o1); break;
    case QuantScheme::kInt4: rows_scheme<QuantScheme::kInt4>(w, a, m0, mb, y, ldy, o0, o1); break;
    default: rows_scheme<QuantScheme::kFp8>(w, a, m0, mb, y, ldy, o0, o1); break;
  }
}

void rows_s8_avx512(const QuantWeight& w, const Activations& a, int64_t m0, int mb, float* y,
                    int64_t ldy, int64_t o0, int64_t o1, bool vnni) {
  if (vnni)
    rows_s8_any<true>(w, a, m0, mb, y, ldy, o0, o1);
  else
    rows_s8_any<false>(w, a, m0, mb, y, ldy, o0, o1);
}

}  // namespace tessera::kernels::cpu
