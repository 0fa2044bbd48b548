// The quantized GEMV's AVX-512 row kernels. Float schemes: each 32-weight run is widened to
// f32 sixteen codes per register and FMA'd against f32 activations, four output rows at
// a time for one row of x so the activations are loaded once for the four; the group's
// scale multiplies its partial sums and the zero point comes off as s z sum(x_group)
// (quant_cpu.cc's prepare). W8A8: |w| as u8 times x with w's sign, into exact int32 sums
// (vpdpbusd with VNNI, vpmaddubsw + vpmaddwd without).
// GCC 12 warns about its own _mm512_undefined_* placeholders (GCC PR 105593).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "tessera/kernels/cpu/avx512_math.h"
#include "tessera/kernels/cpu/quant_rows.h"
#include "tessera/kernels/dispatch.h"
#include "tessera/kernels/reference/quant_ref.h"

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
  } else {  // kFp8: value / 256, exact (avx512::e4m3_over_256)
    v0 = avx512::e4m3_over_256(p);
    v1 = avx512::e4m3_over_256(p + 16);
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
        _mm_prefetch(reinterpret_cast<const char*>(p + 16384), _MM_HINT_T0);
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

// 64 products of s8 x by s8 w summed into 16 int32 lanes: |w| (u8; a stored -128 is 128)
// times x with w's sign, exact (x in [-127, 127] negates safely; |w| <= 128, |x| <= 127: a
// pair of products stays inside int16 for vpmaddubsw). Negating w instead would wrap -128.
TESSERA_TARGET_AVX512 inline __m512i dot64(__m512i acc, __m512i xv, __m512i wv) {
  const __m512i aw = _mm512_abs_epi8(wv);
  const __m512i sx = _mm512_mask_sub_epi8(xv, _mm512_movepi8_mask(wv), _mm512_setzero_si512(), xv);
  const __m512i p16 = _mm512_maddubs_epi16(aw, sx);
  return _mm512_add_epi32(acc, _mm512_madd_epi16(p16, _mm512_set1_epi16(1)));
}
TESSERA_TARGET_AVX512_VNNI inline __m512i dot64_vnni(__m512i acc, __m512i xv, __m512i wv) {
  const __m512i aw = _mm512_abs_epi8(wv);
  const __m512i sx = _mm512_mask_sub_epi8(xv, _mm512_movepi8_mask(wv), _mm512_setzero_si512(), xv);
  return _mm512_dpbusd_epi32(acc, aw, sx);
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

// ---- integer-dot GEMV (int4, int8 codes x s8 runs of x) ------------------------------

// How far ahead of each row's reads the int-dot kernels prefetch its codes, into L2: the
// decode GEMV streams weights from memory, and two cores alone do not keep enough reads in
// flight (1b shapes, alternating runs: int8 24.3-25.4 GB/s with T0 hints 16 KB ahead,
// 26.2-26.4 with T1 64 KB ahead; int4 24.9-25.6 against 25.8-26.0; NTA hints halved it).
// On huge pages (base/aligned_alloc.h) 16-32 KiB beat 64 (Zen 4, int4 decode, 2 rounds:
// 8 KiB 56.7 / 55.8 tok/s, 16 KiB 60.2 / 60.4, 32 KiB 59.5 / 59.4, 64 KiB 56.6 / 54.6, 256
// KiB 47.8 / 50.5; int8 unchanged); on 4 KiB pages 32 KiB matches 64 (38.6 / 44.3 against
// 37.7 / 41.8).
constexpr int64_t kPrefetchAhead = 32768;

// Columns per product chunk: 64 packed bytes of int4 (two nibbles each), 64 int8 codes.
int64_t int_dot_chunk(const QuantWeight& w) { return w.scheme == QuantScheme::kInt4 ? 128 : 64; }

// 4-byte groups of u8 w times s8 x, summed into 16 int32 lanes: vpdpbusd, or without VNNI
// vpmaddubsw (int16 pair sums: exact for int4 codes) and vpmaddwd.
TESSERA_TARGET_AVX512_VNNI inline __m512i udot_vnni(__m512i acc, __m512i w, __m512i x) {
  return _mm512_dpbusd_epi32(acc, w, x);
}
TESSERA_TARGET_AVX512 inline __m512i udot_bw(__m512i acc, __m512i w, __m512i x) {
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), _mm512_set1_epi16(1)));
}
TESSERA_TARGET_AVX512_VNNI inline __m128i udot128_vnni(__m128i acc, __m128i w, __m128i x) {
  return _mm_dpbusd_epi32(acc, w, x);
}
TESSERA_TARGET_AVX512 inline __m128i udot128_bw(__m128i acc, __m128i w, __m128i x) {
  return _mm_add_epi32(acc, _mm_madd_epi16(_mm_maddubs_epi16(w, x), _mm_set1_epi16(1)));
}
TESSERA_TARGET_AVX512 inline int32_t hsum128(__m128i v) {
  v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0x4E));
  v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0xB1));
  return _mm_cvtsi128_si32(v);
}

// NR output rows against MB rows of x. Per chunk and row: the codes' int32 lane sums,
// widened and multiplied by (x's run scale) x (the weight's group scale) per lane, into
// f32 totals; runs past the last whole chunk go 32 columns at a time.
#define TESSERA_INT_DOT_BLOCK(NAME, TARGET, UDOT, UDOT128)                                       \
  template <QuantScheme S, int MB, int NR, bool kOneGroup>                                       \
  TARGET void NAME(const QuantWeight& w, const Activations& a, int64_t m0, float* y, int64_t ldy, \
                   int64_t o, const int32_t* idx, __mmask16 smask) {                            \
    constexpr bool kInt4 = S == QuantScheme::kInt4;                                              \
    constexpr int64_t kChunk = kInt4 ? 128 : 64;                                                 \
    const int64_t in = w.in, G = w.groups(), gs = w.group, rb = row_bytes(w);                    \
    const int64_t chunks = in / kChunk, runs = in / 32;                                          \
    const uint8_t* rows[NR];                                                                     \
    for (int r = 0; r < NR; ++r) rows[r] = w.q.data<uint8_t>() + (o + r) * rb;                   \
    const float* sc = w.scales.data<float>() + o * G;                                            \
    const float* zp = w.zeros.data<float>() + o * G;                                             \
    const __m512i vidx = _mm512_loadu_si512(idx);                                                \
    const __m512i nib = _mm512_set1_epi8(0x0F);                                                  \
    __m512 total[NR][MB];                                                                        \
    float tail[NR][MB] = {};                                                                     \
    for (int r = 0; r < NR; ++r)                                                                 \
      for (int m = 0; m < MB; ++m) total[r][m] = _mm512_setzero_ps();                            \
    GroupCursor cursor(gs);                                                                      \
    for (int64_t c = 0; c < chunks; ++c) {                                                       \
      const int64_t j0 = c * kChunk, g0 = cursor.advance(kChunk);                                \
      __m512i x0[MB], x1[MB];                                                                    \
      __m512 xs[MB];                                                                             \
      for (int m = 0; m < MB; ++m) {                                                             \
        const int8_t* xr = a.xd.data() + (m0 + m) * in + j0;                                     \
        x0[m] = _mm512_loadu_si512(xr);                                                          \
        if (kInt4) x1[m] = _mm512_loadu_si512(xr + 64);                                          \
        xs[m] = _mm512_loadu_ps(a.lane_scale.data() + ((m0 + m) * chunks + c) * 16);             \
      }                                                                                          \
      for (int r = 0; r < NR; ++r) {                                                             \
        const uint8_t* p = rows[r] + (kInt4 ? j0 / 2 : j0);                                      \
        _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchAhead), _MM_HINT_T1);            \
        const __m512i wv = _mm512_loadu_si512(p);                                                \
        /* A chunk inside one group (per-channel int8, int4 g >= 128): its scale broadcast;  \
           else each lane's group scale. */                                                   \
        const __m512 ws = kOneGroup ? _mm512_set1_ps(sc[r * G + g0])                            \
                                    : _mm512_permutexvar_ps(vidx, _mm512_maskz_loadu_ps(smask, sc + r * G + g0)); \
        __m512i lo = wv, hi = wv;                                                                \
        if (kInt4) {                                                                             \
          lo = _mm512_and_si512(wv, nib);                                                        \
          hi = _mm512_and_si512(_mm512_srli_epi16(wv, 4), nib);                                  \
        }                                                                                        \
        for (int m = 0; m < MB; ++m) {                                                           \
          __m512i acc = UDOT(_mm512_setzero_si512(), lo, x0[m]);                                 \
          if (kInt4) acc = UDOT(acc, hi, x1[m]);                                                 \
          total[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(xs[m], ws), total[r][m]); \
        }                                                                                        \
      }                                                                                          \
    }                                                                                            \
    for (int64_t t = chunks * kChunk / 32; t < runs; ++t) {                                      \
      const int64_t gt = 32 * t / gs;                                                            \
      for (int r = 0; r < NR; ++r) {                                                             \
        const float s = sc[r * G + gt];                                                          \
        __m128i w0, w1;                                                                          \
        if (kInt4) {                                                                             \
          const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[r] + 16 * t)); \
          w0 = _mm_and_si128(b, _mm_set1_epi8(0x0F));                                            \
          w1 = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F));                         \
        } else {                                                                                 \
          w0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[r] + 32 * t));              \
          w1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[r] + 32 * t + 16));         \
        }                                                                                        \
        for (int m = 0; m < MB; ++m) {                                                           \
          const int8_t* xr = a.xd.data() + (m0 + m) * in + 32 * t;                               \
          __m128i acc = UDOT128(_mm_setzero_si128(), w0, _mm_loadu_si128(reinterpret_cast<const __m128i*>(xr))); \
          acc = UDOT128(acc, w1, _mm_loadu_si128(reinterpret_cast<const __m128i*>(xr + 16)));    \
          tail[r][m] += static_cast<float>(hsum128(acc)) * a.run_scale[(m0 + m) * runs + t] * s; \
        }                                                                                        \
      }                                                                                          \
    }                                                                                            \
    for (int r = 0; r < NR; ++r)                                                                 \
      for (int m = 0; m < MB; ++m) {                                                             \
        float corr = 0.f;                                                                        \
        const float* xsum = a.xsum.data() + (m0 + m) * G;                                        \
        for (int64_t g = 0; g < G; ++g) corr += sc[r * G + g] * zp[r * G + g] * xsum[g];         \
        y[(m0 + m) * ldy + o + r] = _mm512_reduce_add_ps(total[r][m]) + tail[r][m] - corr;       \
      }                                                                                          \
  }
TESSERA_INT_DOT_BLOCK(int_dot_bw, TESSERA_TARGET_AVX512, udot_bw, udot128_bw)
TESSERA_INT_DOT_BLOCK(int_dot_vnni, TESSERA_TARGET_AVX512_VNNI, udot_vnni, udot128_vnni)
#undef TESSERA_INT_DOT_BLOCK

template <QuantScheme S, int MB, bool VNNI>
void int_dot_rows(const QuantWeight& w, const Activations& a, int64_t m0, float* y, int64_t ldy,
                  int64_t o0, int64_t o1) {
  constexpr int NR = MB == 1 ? 4 : MB == 2 ? 2 : 1;
  constexpr int64_t kChunk = S == QuantScheme::kInt4 ? 128 : 64;
  // Lane l of a chunk covers 8 columns of int4 run l / 4, or int8 columns [4 l, 4 l + 4):
  // the offset of its weight group from the chunk's first, and how many groups to load.
  const int64_t gs = w.group;
  int32_t idx[16];
  for (int l = 0; l < 16; ++l)
    idx[l] = gs >= kChunk ? 0 : static_cast<int32_t>((S == QuantScheme::kInt4 ? 32 * (l / 4) : 4 * l) / gs);
  const auto smask = static_cast<__mmask16>((1u << (gs >= kChunk ? 1 : kChunk / gs)) - 1);
  const bool one_group = gs >= kChunk;
  const auto run = [&](auto nr, int64_t o) {
    constexpr int kNr = decltype(nr)::value;
    if constexpr (VNNI) {
      if (one_group)
        int_dot_vnni<S, MB, kNr, true>(w, a, m0, y, ldy, o, idx, smask);
      else
        int_dot_vnni<S, MB, kNr, false>(w, a, m0, y, ldy, o, idx, smask);
    } else {
      if (one_group)
        int_dot_bw<S, MB, kNr, true>(w, a, m0, y, ldy, o, idx, smask);
      else
        int_dot_bw<S, MB, kNr, false>(w, a, m0, y, ldy, o, idx, smask);
    }
  };
  if (m0 == 0) {
    // The range's first kPrefetchAhead bytes, which the kernel's own prefetches never ask
    // for: requested at once rather than as the loads reach them.
    const auto* first = reinterpret_cast<const char*>(w.q.data<uint8_t>() + o0 * row_bytes(w));
    const int64_t span = std::min(kPrefetchAhead, (o1 - o0) * row_bytes(w));
    for (int64_t b = 0; b < span; b += 64) _mm_prefetch(first + b, _MM_HINT_T1);
  }
  int64_t o = o0;
  for (; o + NR <= o1; o += NR) run(std::integral_constant<int, NR>{}, o);
  for (; o < o1; ++o) run(std::integral_constant<int, 1>{}, o);
}

template <QuantScheme S, bool VNNI>
void int_dot_scheme(const QuantWeight& w, const Activations& a, int64_t m0, int mb, float* y,
                    int64_t ldy, int64_t o0, int64_t o1) {
  switch (mb) {
    case 1: int_dot_rows<S, 1, VNNI>(w, a, m0, y, ldy, o0, o1); break;
    case 2: int_dot_rows<S, 2, VNNI>(w, a, m0, y, ldy, o0, o1); break;
    case 3: int_dot_rows<S, 3, VNNI>(w, a, m0, y, ldy, o0, o1); break;
    default: int_dot_rows<S, 4, VNNI>(w, a, m0, y, ldy, o0, o1); break;
  }
}

}  // namespace

bool gemv_quantizes_activations(const QuantWeight& w, QuantIsa isa) {
  // A chunk's lanes must see whole groups or lie inside one (the per-lane scale pattern is
  // then the same in every chunk).
  const int64_t chunk = int_dot_chunk(w);
  if (w.in % 32 != 0 || w.group % 32 != 0 || !w.zeros.defined()) return false;
  if (w.group % chunk != 0 && chunk % w.group != 0) return false;
  if (w.scheme == QuantScheme::kInt4) return isa >= QuantIsa::kAvx2;
  return w.scheme == QuantScheme::kInt8 && (isa == QuantIsa::kAvx2 || isa >= QuantIsa::kAvx512Vnni);
}

TESSERA_TARGET_AVX512 float quantize_row_s8_avx512(const float* x, int64_t n, int8_t* q) {
  __m512 vmax = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(x + k)));
  float amax = _mm512_reduce_max_ps(vmax);
  for (int64_t t = k; t < n; ++t) amax = std::max(amax, std::fabs(x[t]));
  const float s = amax > 0 ? amax / 127.f : 1.f;
  const __m512 vs = _mm512_set1_ps(s), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  for (k = 0; k + 16 <= n; k += 16) {
    // x / s rounded to nearest even (vcvtps2dq under the default rounding mode, as nearbyint).
    const __m512 v = _mm512_min_ps(_mm512_max_ps(_mm512_div_ps(_mm512_loadu_ps(x + k), vs), lo), hi);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v)));
  }
  for (; k < n; ++k) q[k] = static_cast<int8_t>(std::clamp(std::nearbyint(x[k] / s), -127.f, 127.f));
  return s;
}

void prepare_int_dot(const QuantWeight& w, Activations& a) {
  const int64_t in = w.in, runs = in / 32, chunk = int_dot_chunk(w), chunks = in / chunk;
  const bool int4 = w.scheme == QuantScheme::kInt4;
  a.xd.resize(a.rows * in);
  a.run_scale.resize(a.rows * runs);
  a.lane_scale.resize(a.rows * chunks * 16);
  int8_t q[32];
  for (int64_t m = 0; m < a.rows; ++m) {
    const float* x = a.x + m * a.ld;
    int8_t* xd = a.xd.data() + m * in;
    float* rs = a.run_scale.data() + m * runs;
    for (int64_t t = 0; t < runs; ++t) {
      rs[t] = quantize_row_s8_fast(x + 32 * t, 32, q);
      const int64_t c = (32 * t) / chunk, i = t % 4;
      if (int4 && c < chunks) {  // run i of a 128-column chunk: first half, then second half
        std::copy(q, q + 16, xd + c * 128 + 16 * i);
        std::copy(q + 16, q + 32, xd + c * 128 + 64 + 16 * i);
      } else {
        std::copy(q, q + 32, xd + 32 * t);
      }
    }
    for (int64_t c = 0; c < chunks; ++c)
      for (int l = 0; l < 16; ++l)
        a.lane_scale[(m * chunks + c) * 16 + l] = rs[int4 ? 4 * c + l / 4 : 2 * c + l / 8];
  }
  if (int4) return;
  const int64_t G = w.groups();
  a.qsum.assign(a.rows * G, 0.f);
  for (int64_t m = 0; m < a.rows; ++m)
    for (int64_t t = 0; t < runs; ++t) {
      int32_t codes = 0;
      for (int64_t j = 32 * t; j < 32 * t + 32; ++j) codes += a.xd[m * in + j];
      a.qsum[m * G + 32 * t / w.group] += a.run_scale[m * runs + t] * static_cast<float>(codes);
    }
}

void rows_int_dot_avx512(const QuantWeight& w, const Activations& a, int64_t m0, int mb, float* y,
                         int64_t ldy, int64_t o0, int64_t o1, bool vnni) {
  if (w.scheme == QuantScheme::kInt4) {
    if (vnni)
      int_dot_scheme<QuantScheme::kInt4, true>(w, a, m0, mb, y, ldy, o0, o1);
    else
      int_dot_scheme<QuantScheme::kInt4, false>(w, a, m0, mb, y, ldy, o0, o1);
  } else {
    int_dot_scheme<QuantScheme::kInt8, true>(w, a, m0, mb, y, ldy, o0, o1);
  }
}

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
