// Quantized products on the CPU. Decode is bound by the bytes of W it streams, so the
// GEMV widens each 32-weight run to f32 in registers and FMAs it against f32 activations
// (W8A16 / W4A16 keep the activations in float); the per-group scale multiplies the
// group's partial sums and the zero point comes off as s z sum(x_group), precomputed per
// row of x; int4 and int8 (from AVX2; AVX-512 int8 with VNNI) instead multiply their codes by x quantized
// to s8 per 32-column run, in integers. Prefill dequantizes blocks of W into a float GEMM.
// W8A8 multiplies s8 by s8 into exact int32 sums (AVX2: |w| u8 times x with w's sign,
// vpmaddubsw, which cannot saturate at 128 x 127 x 2).
// GCC 12 warns about its own _mm256_undefined_* placeholders (GCC PR 105593).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include "tessera/kernels/cpu/quant_cpu.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <type_traits>
#include <vector>

#include "tessera/base/cpu_features.h"
#include "tessera/base/error.h"
#include "tessera/base/thread_pool.h"
#include "tessera/kernels/bf16_speed.h"
#include "tessera/kernels/cpu/avx2_math.h"
#include "tessera/kernels/cpu/matmul_cpu.h"
#include "tessera/kernels/cpu/quant_rows.h"
#include "tessera/kernels/dispatch.h"
#include "tessera/kernels/matmul.h"
#include "tessera/kernels/reference/quant_ref.h"

#define TESSERA_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace tessera::kernels::cpu {
namespace {

void prepare(const Tensor& x, const QuantWeight& w, Activations& a) {
  a.rows = x.size(0);
  a.x = x.data<float>();
  a.ld = a.rows > 1 ? x.stride(0) : w.in;
  a.permuted = w.perm.defined() || w.smooth.defined();
  if (a.permuted) {
    a.scratch.resize(a.rows * w.in);
    const int32_t* perm = w.perm.defined() ? w.perm.data<int32_t>() : nullptr;
    const float* sm = w.smooth.defined() ? w.smooth.data<float>() : nullptr;
    for (int64_t m = 0; m < a.rows; ++m) {
      const float* src = a.x + m * a.ld;
      float* dst = a.scratch.data() + m * w.in;
      for (int64_t j = 0; j < w.in; ++j) {
        const int64_t k = perm ? perm[j] : j;
        dst[j] = sm ? src[k] / sm[k] : src[k];
      }
    }
    a.x = a.scratch.data();
    a.ld = w.in;
  }
  if (w.zeros.defined()) {
    const int64_t G = w.groups();
    a.xsum.assign(a.rows * G, 0.f);
    for (int64_t m = 0; m < a.rows; ++m)
      for (int64_t g = 0; g < G; ++g) {
        float s = 0.f;
        const float* p = a.x + m * a.ld + g * w.group;
        for (int64_t i = 0; i < w.group; ++i) s += p[i];
        a.xsum[m * G + g] = s;
      }
  }
  if (w.scheme == QuantScheme::kW8A8) {
    a.xq.resize(a.rows * w.in);
    a.xscale.resize(a.rows);
    // (a is thread_local: the workers get its buffers, not its name.)
    const float* xs = a.x;
    const int64_t ld = a.ld, in = w.in;
    int8_t* xq = a.xq.data();
    float* xscale = a.xscale.data();
    base::parallel_for(a.rows, 16, [=](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m)
        xscale[m] = quantize_row_s8_fast(xs + m * ld, in, xq + m * in);
    });
  }
}

}  // namespace

TESSERA_TARGET_AVX2 float quantize_row_s8_avx2(const float* x, int64_t n, int8_t* q) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 vmax = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) vmax = _mm256_max_ps(vmax, _mm256_and_ps(_mm256_loadu_ps(x + k), abs_mask));
  float amax = avx2::hmax8(vmax);
  for (int64_t t = k; t < n; ++t) amax = std::max(amax, std::fabs(x[t]));
  const float s = amax > 0 ? amax / 127.f : 1.f;
  const __m256 vs = _mm256_set1_ps(s), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  // x / s rounded to nearest even (vcvtps2dq under the default rounding mode, as nearbyint),
  // 32 at a time: two packs interleave the 128-bit halves, one permute restores the order.
#define TESSERA_QUANT8(at) \
  _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(_mm256_div_ps(_mm256_loadu_ps(x + (at)), vs), lo), hi))
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (k = 0; k + 32 <= n; k += 32) {
    const __m256i w01 = _mm256_packs_epi32(TESSERA_QUANT8(k), TESSERA_QUANT8(k + 8));
    const __m256i w23 = _mm256_packs_epi32(TESSERA_QUANT8(k + 16), TESSERA_QUANT8(k + 24));
    const __m256i b = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w01, w23), order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k), b);
  }
#undef TESSERA_QUANT8
  for (; k < n; ++k) q[k] = static_cast<int8_t>(std::clamp(std::nearbyint(x[k] / s), -127.f, 127.f));
  return s;
}

float quantize_row_s8_fast(const float* x, int64_t n, int8_t* q) {
  if (cpu_has(IsaLevel::kAvx512)) return quantize_row_s8_avx512(x, n, q);
  if (cpu_has(IsaLevel::kAvx2)) return quantize_row_s8_avx2(x, n, q);
  return reference::quantize_row_s8(x, n, q);
}

namespace {

// ---- float schemes (int8, int4, fp8), scalar -----------------------------------------

void rows_scalar(const QuantWeight& w, const Activations& a, int64_t m0, int mb, float* y,
                 int64_t ldy, int64_t o0, int64_t o1) {
  const int64_t G = w.groups(), rb = row_bytes(w);
  for (int64_t o = o0; o < o1; ++o) {
    const uint8_t* row = w.q.data<uint8_t>() + o * rb;
    for (int m = 0; m < mb; ++m) {
      const float* x = a.x + (m0 + m) * a.ld;
      float total = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        float acc = 0.f;
        for (int64_t j = g * w.group; j < (g + 1) * w.group; ++j) acc += x[j] * unscaled(w.scheme, row, j);
        const float s = w.scales.data<float>()[o * G + g];
        total += s * acc;
        if (w.zeros.defined()) total -= s * w.zeros.data<float>()[o * G + g] * a.xsum[(m0 + m) * G + g];
      }
      y[(m0 + m) * ldy + o] = total;
    }
  }
}

// ---- float schemes, AVX2 -------------------------------------------------------------

// 32 stored weights from byte offset `p` of a row, widened to f32 (before the scale).
// fp8 values come out 2^-8 times too small (the e4m3 bits placed in an f16's); the
// caller multiplies the scale by 256.
template <QuantScheme S>
TESSERA_TARGET_AVX2 inline void unpack32(const uint8_t* p, __m256 v[4]) {
  if constexpr (S == QuantScheme::kInt8) {
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i)
      v[i] = _mm256_cvtepi32_ps(
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * i))));
  } else if constexpr (S == QuantScheme::kInt4) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(b, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    v[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    v[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    v[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    v[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
  } else {  // kFp8: e4m3 s.eeee.mmm -> f16 s.0eeee.mmm0000000 (value / 256, exact)
    const __m128i m7f = _mm_set1_epi16(0x7F), m80 = _mm_set1_epi16(0x80);
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * i)));
      const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, m7f), 7),
                                     _mm_slli_epi16(_mm_and_si128(b, m80), 8));
      v[i] = _mm256_cvtph_ps(h);
    }
  }
}

using avx2::hsum8;

// The sum of the 8 int32 lanes; low_only: of the low 4 (v's upper half is undefined).
TESSERA_TARGET_AVX2 inline int32_t hsum8_epi32(__m256i v, bool low_only = false) {
  __m128i s = _mm256_castsi256_si128(v);
  if (!low_only) s = _mm_add_epi32(s, _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// NR rows of W against MB rows of x. Four accumulators per (row, x row) inside a group
// (one per 8-weight lane of the 32-run, so no FMA waits on the previous one), folded into
// the running total with the group's scale at the group's end.
template <QuantScheme S, int MB, int NR>
TESSERA_TARGET_AVX2 void block_avx2(const QuantWeight& w, const Activations& a, int64_t m0,
                                    float* y, int64_t ldy, int64_t o) {
  const int64_t G = w.groups(), rb = row_bytes(w), gs = w.group;
  const uint8_t* rows[NR];
  for (int r = 0; r < NR; ++r) rows[r] = w.q.data<uint8_t>() + (o + r) * rb;
  const float* sc = w.scales.data<float>() + o * G;
  const float* zp = w.zeros.defined() ? w.zeros.data<float>() + o * G : nullptr;
  const float unit = S == QuantScheme::kFp8 ? 256.f : 1.f;
  __m256 total[NR][MB];
  float corr[NR][MB] = {};
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MB; ++m) total[r][m] = _mm256_setzero_ps();
  const int64_t per_byte = S == QuantScheme::kInt4 ? 2 : 1;
  for (int64_t g = 0; g < G; ++g) {
    __m256 acc[NR][MB][4];
    for (int r = 0; r < NR; ++r)
      for (int m = 0; m < MB; ++m)
        for (int i = 0; i < 4; ++i) acc[r][m][i] = _mm256_setzero_ps();
    const int64_t j0 = g * gs, j1 = j0 + gs;
    int64_t j = j0;
    for (; j + 32 <= j1; j += 32) {
      for (int r = 0; r < NR; ++r) {
        _mm_prefetch(reinterpret_cast<const char*>(rows[r] + j / per_byte + 512), _MM_HINT_T0);
        __m256 v[4];
        unpack32<S>(rows[r] + j / per_byte, v);
        for (int m = 0; m < MB; ++m) {
          const float* x = a.x + (m0 + m) * a.ld + j;
#pragma GCC unroll 4
          for (int i = 0; i < 4; ++i)
            acc[r][m][i] = _mm256_fmadd_ps(_mm256_loadu_ps(x + 8 * i), v[i], acc[r][m][i]);
        }
      }
    }
    for (int r = 0; r < NR; ++r) {
      const float s = sc[r * G + g] * unit;
      const __m256 sv = _mm256_set1_ps(s);
      for (int m = 0; m < MB; ++m) {
        const __m256 sum = _mm256_add_ps(_mm256_add_ps(acc[r][m][0], acc[r][m][1]),
                                         _mm256_add_ps(acc[r][m][2], acc[r][m][3]));
        total[r][m] = _mm256_fmadd_ps(sum, sv, total[r][m]);
        if (j < j1) {  // a group that is not a multiple of 32 (int8 / fp8 only)
          const float* x = a.x + (m0 + m) * a.ld;
          float t = 0.f;
          for (int64_t jj = j; jj < j1; ++jj) t += x[jj] * unscaled(S, rows[r], jj);
          corr[r][m] -= sc[r * G + g] * t;
        }
        if (zp) corr[r][m] += sc[r * G + g] * zp[r * G + g] * a.xsum[(m0 + m) * G + g];
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MB; ++m) y[(m0 + m) * ldy + o + r] = hsum8(total[r][m]) - corr[r][m];
}

template <QuantScheme S, int MB>
void rows_avx2(const QuantWeight& w, const Activations& a, int64_t m0, float* y, int64_t ldy,
               int64_t o0, int64_t o1) {
  constexpr int NR = MB == 1 ? 2 : 1;
  int64_t o = o0;
  for (; o + NR <= o1; o += NR) block_avx2<S, MB, NR>(w, a, m0, y, ldy, o);
  for (; o < o1; ++o) block_avx2<S, MB, 1>(w, a, m0, y, ldy, o);
}

template <QuantScheme S>
void rows_avx2(const QuantWeight& w, const Activations& a, int64_t m0, int mb, float* y,
               int64_t ldy, int64_t o0, int64_t o1) {
  switch (mb) {
    case 1: rows_avx2<S, 1>(w, a, m0, y, ldy, o0, o1); break;
    case 2: rows_avx2<S, 2>(w, a, m0, y, ldy, o0, o1); break;
    case 3: rows_avx2<S, 3>(w, a, m0, y, ldy, o0, o1); break;
    default: rows_avx2<S, 4>(w, a, m0, y, ldy, o0, o1); break;
  }
}

// ---- integer-dot GEMV, AVX2 (int4 codes x s8 runs of x) ------------------------------

// The AVX-512 kernel's arithmetic at half the width: each 128-column chunk (prepare_int_dot's
// x layout) as two halves of two runs; vpmaddubsw's int16 pair sums are exact for int4
// codes (15 x 127 x 2), vpmaddwd sums them into 8 int32 lanes, lanes 0-3 run 2h and 4-7
// run 2h + 1 of the half h. Per half and row: the lanes widened and multiplied by (x's run
// scale) x (the weight's group scale). Runs past the last whole chunk go 32 columns at a time.
template <int MB, int NR>
TESSERA_TARGET_AVX2 void int4_dot_block_avx2(const QuantWeight& w, const Activations& a, int64_t m0, float* y,
                                             int64_t ldy, int64_t o) {
  const int64_t in = w.in, G = w.groups(), gs = w.group, rb = in / 2;
  const int64_t chunks = in / 128, runs = in / 32;
  const uint8_t* rows[NR];
  for (int r = 0; r < NR; ++r) rows[r] = w.q.data<uint8_t>() + (o + r) * rb;
  const float* sc = w.scales.data<float>() + o * G;
  const float* zp = w.zeros.data<float>() + o * G;
  const __m256i nib = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 total[NR][MB];
  float tail[NR][MB] = {};
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MB; ++m) total[r][m] = _mm256_setzero_ps();
  GroupCursor cursor(gs);
  for (int64_t c = 0; c < chunks; ++c)
    for (int h = 0; h < 2; ++h) {
      const int64_t j0 = 128 * c + 64 * h;  // first column of runs 4c + 2h and 4c + 2h + 1
      const int64_t ga = cursor.advance(32), gb = cursor.advance(32);  // runs 4c + 2h, 4c + 2h + 1
      for (int r = 0; r < NR; ++r) {
        const uint8_t* p = rows[r] + j0 / 2;
        _mm_prefetch(reinterpret_cast<const char*>(p + 8192), _MM_HINT_T0);
        const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
        const __m256i lo = _mm256_and_si256(wv, nib), hi = _mm256_and_si256(_mm256_srli_epi16(wv, 4), nib);
        const __m256 ws = _mm256_set_m128(_mm_set1_ps(sc[r * G + gb]), _mm_set1_ps(sc[r * G + ga]));
        for (int m = 0; m < MB; ++m) {
          const int8_t* xr = a.xd.data() + (m0 + m) * in + 128 * c + 32 * h;
          const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr));
          const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + 64));
          const __m256i acc = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(lo, x0), ones),
                                               _mm256_madd_epi16(_mm256_maddubs_epi16(hi, x1), ones));
          const __m256 xs = _mm256_loadu_ps(a.lane_scale.data() + ((m0 + m) * chunks + c) * 16 + 8 * h);
          total[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_mul_ps(xs, ws), total[r][m]);
        }
      }
    }
  const __m128i nib128 = _mm_set1_epi8(0x0F), ones128 = _mm_set1_epi16(1);
  for (int64_t t = chunks * 4; t < runs; ++t)
    for (int r = 0; r < NR; ++r) {
      const float s = sc[r * G + 32 * t / gs];
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[r] + 16 * t));
      const __m128i w0 = _mm_and_si128(b, nib128), w1 = _mm_and_si128(_mm_srli_epi16(b, 4), nib128);
      for (int m = 0; m < MB; ++m) {
        const int8_t* xr = a.xd.data() + (m0 + m) * in + 32 * t;
        const __m128i acc = _mm_add_epi32(
            _mm_madd_epi16(_mm_maddubs_epi16(w0, _mm_loadu_si128(reinterpret_cast<const __m128i*>(xr))), ones128),
            _mm_madd_epi16(_mm_maddubs_epi16(w1, _mm_loadu_si128(reinterpret_cast<const __m128i*>(xr + 16))), ones128));
        tail[r][m] += static_cast<float>(hsum8_epi32(_mm256_castsi128_si256(acc), true)) *
                      a.run_scale[(m0 + m) * runs + t] * s;
      }
    }
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MB; ++m) {
      float corr = 0.f;
      const float* xsum = a.xsum.data() + (m0 + m) * G;
      for (int64_t g = 0; g < G; ++g) corr += sc[r * G + g] * zp[r * G + g] * xsum[g];
      y[(m0 + m) * ldy + o + r] = hsum8(total[r][m]) + tail[r][m] - corr;
    }
}


// ---- integer-dot GEMV, AVX2 (int8 codes x s8 runs of x) ------------------------------

// Per 32-column run: the codes less 128 (c ^ 0x80 read as s8, in [-128, 127]) as |.| u8
// times x with their sign (vpsignb on x, which never negates -128), vpmaddubsw: pair sums
// of at most 128 x 127 x 2, exact in int16. The run's 8 int32 lanes are widened and FMA'd
// with x's run scale into the group's sum, which takes the group scale at the group's end.
// The 128 taken off each code comes back as 128 x the group's qsum (prepare_int_dot).
template <int MB, int NR>
TESSERA_TARGET_AVX2 void int8_dot_block_avx2(const QuantWeight& w, const Activations& a, int64_t m0, float* y,
                                             int64_t ldy, int64_t o) {
  const int64_t in = w.in, G = w.groups(), runs = in / 32, per_group = w.group / 32;
  const uint8_t* rows[NR];
  for (int r = 0; r < NR; ++r) rows[r] = w.q.data<uint8_t>() + (o + r) * in;
  const float* sc = w.scales.data<float>() + o * G;
  const float* zp = w.zeros.data<float>() + o * G;
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  __m256 total[NR][MB];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MB; ++m) total[r][m] = _mm256_setzero_ps();
  for (int64_t g = 0, t = 0; g < G; ++g) {
    __m256 acc[NR][MB];
    for (int r = 0; r < NR; ++r)
      for (int m = 0; m < MB; ++m) acc[r][m] = _mm256_setzero_ps();
    for (const int64_t t1 = t + per_group; t < t1; ++t) {
      __m256i xv[MB];
      __m256 xs[MB];
      for (int m = 0; m < MB; ++m) {
        xv[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.xd.data() + (m0 + m) * in + 32 * t));
        xs[m] = _mm256_broadcast_ss(a.run_scale.data() + (m0 + m) * runs + t);
      }
      for (int r = 0; r < NR; ++r) {
        const uint8_t* p = rows[r] + 32 * t;
        _mm_prefetch(reinterpret_cast<const char*>(p + 8192), _MM_HINT_T0);
        const __m256i wv = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), flip);
        const __m256i wa = _mm256_abs_epi8(wv);
        for (int m = 0; m < MB; ++m) {
          const __m256i p16 = _mm256_maddubs_epi16(wa, _mm256_sign_epi8(xv[m], wv));
          acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones)), xs[m], acc[r][m]);
        }
      }
    }
    for (int r = 0; r < NR; ++r) {
      const __m256 ws = _mm256_set1_ps(sc[r * G + g]);
      for (int m = 0; m < MB; ++m) total[r][m] = _mm256_fmadd_ps(acc[r][m], ws, total[r][m]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MB; ++m) {
      float corr = 0.f;
      const float* xsum = a.xsum.data() + (m0 + m) * G;
      const float* qsum = a.qsum.data() + (m0 + m) * G;
      for (int64_t g = 0; g < G; ++g) corr += sc[r * G + g] * (zp[r * G + g] * xsum[g] - 128.f * qsum[g]);
      y[(m0 + m) * ldy + o + r] = hsum8(total[r][m]) - corr;
    }
}

// Rows [o0, o1) of either scheme: NR output rows per block (fewer as x has more rows).
template <QuantScheme S, int MB>
void int_dot_rows_avx2(const QuantWeight& w, const Activations& a, int64_t m0, float* y, int64_t ldy,
                       int64_t o0, int64_t o1) {
  constexpr int NR = MB == 1 ? 4 : MB == 2 ? 2 : 1;
  const auto block = [&](auto nr, int64_t o) {
    if constexpr (S == QuantScheme::kInt8)
      int8_dot_block_avx2<MB, decltype(nr)::value>(w, a, m0, y, ldy, o);
    else
      int4_dot_block_avx2<MB, decltype(nr)::value>(w, a, m0, y, ldy, o);
  };
  int64_t o = o0;
  for (; o + NR <= o1; o += NR) block(std::integral_constant<int, NR>{}, o);
  for (; o < o1; ++o) block(std::integral_constant<int, 1>{}, o);
}

template <QuantScheme S>
void int_dot_scheme_avx2(const QuantWeight& w, const Activations& a, int64_t m0, int mb, float* y, int64_t ldy,
                         int64_t o0, int64_t o1) {
  switch (mb) {
    case 1: int_dot_rows_avx2<S, 1>(w, a, m0, y, ldy, o0, o1); break;
    case 2: int_dot_rows_avx2<S, 2>(w, a, m0, y, ldy, o0, o1); break;
    case 3: int_dot_rows_avx2<S, 3>(w, a, m0, y, ldy, o0, o1); break;
    default: int_dot_rows_avx2<S, 4>(w, a, m0, y, ldy, o0, o1); break;
  }
}

void rows_int_dot_avx2(const QuantWeight& w, const Activations& a, int64_t m0, int mb, float* y, int64_t ldy,
                       int64_t o0, int64_t o1) {
  if (w.scheme == QuantScheme::kInt8)
    int_dot_scheme_avx2<QuantScheme::kInt8>(w, a, m0, mb, y, ldy, o0, o1);
  else
    int_dot_scheme_avx2<QuantScheme::kInt4>(w, a, m0, mb, y, ldy, o0, o1);
}

// ---- W8A8 ----------------------------------------------------------------------------

void rows_s8_scalar(const QuantWeight& w, const Activations& a, int64_t m0, int mb, float* y,
                    int64_t ldy, int64_t o0, int64_t o1) {
  for (int64_t o = o0; o < o1; ++o) {
    const int8_t* row = w.q.data<int8_t>() + o * w.in;
    for (int m = 0; m < mb; ++m) {
      const int8_t* xq = a.xq.data() + (m0 + m) * w.in;
      int32_t acc = 0;
      for (int64_t k = 0; k < w.in; ++k) acc += int32_t{xq[k]} * row[k];
      y[(m0 + m) * ldy + o] = static_cast<float>(acc) * a.xscale[m0 + m] * w.scales.data<float>()[o];
    }
  }
}

template <int MB>
TESSERA_TARGET_AVX2 void rows_s8_avx2(const QuantWeight& w, const Activations& a, int64_t m0,
                                      float* y, int64_t ldy, int64_t o0, int64_t o1) {
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t K = w.in, K32 = K / 32 * 32;
  for (int64_t o = o0; o < o1; ++o) {
    const int8_t* row = w.q.data<int8_t>() + o * K;
    __m256i acc[MB];
    for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_si256();
    for (int64_t k = 0; k < K32; k += 32) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k));
      const __m256i wa = _mm256_abs_epi8(wv);  // -128 -> 128 as u8: exact (x's sign moves instead)
      for (int m = 0; m < MB; ++m) {
        const __m256i xv =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.xq.data() + (m0 + m) * K + k));
        const __m256i p16 = _mm256_maddubs_epi16(wa, _mm256_sign_epi8(xv, wv));
        acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(p16, ones));
      }
    }
    for (int m = 0; m < MB; ++m) {
      const int8_t* xq = a.xq.data() + (m0 + m) * K;
      int32_t s = hsum8_epi32(acc[m]);
      for (int64_t k = K32; k < K; ++k) s += int32_t{xq[k]} * row[k];
      y[(m0 + m) * ldy + o] = static_cast<float>(s) * a.xscale[m0 + m] * w.scales.data<float>()[o];
    }
  }
}

void rows_s8_avx2(const QuantWeight& w, const Activations& a, int64_t m0, int mb, float* y,
                  int64_t ldy, int64_t o0, int64_t o1) {
  switch (mb) {
    case 1: rows_s8_avx2<1>(w, a, m0, y, ldy, o0, o1); break;
    case 2: rows_s8_avx2<2>(w, a, m0, y, ldy, o0, o1); break;
    case 3: rows_s8_avx2<3>(w, a, m0, y, ldy, o0, o1); break;
    default: rows_s8_avx2<4>(w, a, m0, y, ldy, o0, o1); break;
  }
}

// ---- dispatch over rows --------------------------------------------------------------

void run_rows(const QuantWeight& w, const Activations& a, int64_t m0, int mb, float* y,
              int64_t ldy, int64_t o0, int64_t o1, QuantIsa isa) {
  if (w.scheme == QuantScheme::kW8A8) {
    if (isa >= QuantIsa::kAvx512)
      rows_s8_avx512(w, a, m0, mb, y, ldy, o0, o1, isa >= QuantIsa::kAvx512Vnni);
    else if (isa == QuantIsa::kAvx2)
      rows_s8_avx2(w, a, m0, mb, y, ldy, o0, o1);
    else
      rows_s8_scalar(w, a, m0, mb, y, ldy, o0, o1);
    return;
  }
  if (gemv_quantizes_activations(w, isa)) {
    if (isa == QuantIsa::kAvx2) return rows_int_dot_avx2(w, a, m0, mb, y, ldy, o0, o1);
    return rows_int_dot_avx512(w, a, m0, mb, y, ldy, o0, o1, isa >= QuantIsa::kAvx512Vnni);
  }
  if (isa >= QuantIsa::kAvx512) return rows_avx512(w, a, m0, mb, y, ldy, o0, o1);
  if (isa != QuantIsa::kAvx2) return rows_scalar(w, a, m0, mb, y, ldy, o0, o1);
  switch (w.scheme) {
    case QuantScheme::kInt8: rows_avx2<QuantScheme::kInt8>(w, a, m0, mb, y, ldy, o0, o1); break;
    case QuantScheme::kInt4: rows_avx2<QuantScheme::kInt4>(w, a, m0, mb, y, ldy, o0, o1); break;
    default: rows_avx2<QuantScheme::kFp8>(w, a, m0, mb, y, ldy, o0, o1); break;
  }
}

// The GEMV over all of x, split over output rows across the workers.
// force_quant_isa_for_testing's level, or -1.
std::atomic<int> g_forced_isa{-1};

// More than 4 rows of x (W8A8 prompts without VNNI) take the weight rows in blocks of ~256
// KB, every row of x against one block before the next: each block is read from memory
// once and then from L2, where the whole range once per 4 rows of x was read from memory
// M / 4 times. A row's arithmetic is the same either way.
void gemv_all(const QuantWeight& w, const Activations& a, float* y, int64_t ldy, QuantIsa isa) {
  const int64_t block = a.rows > 4 ? std::max<int64_t>(16, (int64_t{256} << 10) / row_bytes(w)) : w.out;
  base::parallel_for(w.out, 16, [&](int64_t o0, int64_t o1) {
    for (int64_t b0 = o0; b0 < o1; b0 += block)
      for (int64_t m0 = 0; m0 < a.rows; m0 += 4)
        run_rows(w, a, m0, static_cast<int>(std::min<int64_t>(4, a.rows - m0)), y, ldy, b0,
                 std::min(o1, b0 + block), isa);
  });
}

}  // namespace

void force_quant_isa_for_testing(std::optional<QuantIsa> isa) {
  g_forced_isa = isa ? static_cast<int>(*isa) : -1;
}

QuantIsa best_quant_isa() {
  if (const int f = g_forced_isa.load(); f >= 0) return static_cast<QuantIsa>(f);
  if (cpu_has(IsaLevel::kAvx512))
    return base::cpu_features().avx512_vnni ? QuantIsa::kAvx512Vnni : QuantIsa::kAvx512;
  return cpu_has(IsaLevel::kAvx2) ? QuantIsa::kAvx2 : QuantIsa::kScalar;
}

void dequantize_rows(const QuantWeight& w, int64_t o0, int64_t o1, Tensor& dst) {
  const int64_t G = w.groups(), rb = row_bytes(w);
  const bool bf = dst.dtype() == DType::kBF16;
  base::parallel_for(o1 - o0, 8, [&](int64_t r0, int64_t r1) {
    std::vector<float> tmp(w.in);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t o = o0 + r;
      const float* sc = w.scales.data<float>() + o * G;
      const float* zp = w.zeros.defined() ? w.zeros.data<float>() + o * G : nullptr;
      if (w.scheme == QuantScheme::kW8A8) {
        const int8_t* row = w.q.data<int8_t>() + o * w.in;
        for (int64_t j = 0; j < w.in; ++j) tmp[j] = sc[0] * row[j];
      } else {
        const uint8_t* row = w.q.data<uint8_t>() + o * rb;
        for (int64_t g = 0; g < G; ++g) {
          const float s = sc[g], z = zp ? zp[g] : 0.f;
          for (int64_t j = g * w.group, e = std::min(w.in, j + w.group); j < e; ++j)
            tmp[j] = s * (unscaled(w.scheme, row, j) - z);
        }
      }
      if (bf)
        convert_elements(tmp.data(), DType::kF32, dst.data<bf16>() + r * w.in, DType::kBF16, w.in);
      else
        std::copy(tmp.begin(), tmp.end(), dst.data<float>() + r * w.in);
    }
  });
}

void quant_gemv(const Tensor& x, const QuantWeight& w, Tensor& y, QuantIsa isa) {
  thread_local Activations a;
  prepare(x, w, a);
  if (gemv_quantizes_activations(w, isa)) prepare_int_dot(w, a);
  gemv_all(w, a, y.data<float>(), x.size(0) > 1 ? y.stride(0) : w.out, isa);
}

void quant_gemm(const Tensor& x, const QuantWeight& w, Tensor& y, QuantIsa isa) {
  thread_local Activations a;
  prepare(x, w, a);
  const int64_t M = a.rows, ldy = M > 1 ? y.stride(0) : w.out;
  if (w.scheme == QuantScheme::kW8A8 && isa < QuantIsa::kAvx512Vnni) {
    // Without VNNI oneDNN multiplies s8 by s8 through vpmaddubsw on x + 128, whose int16
    // pair sums saturate (wrong results, seen under DNNL_MAX_CPU_ISA=AVX2): the exact
    // row kernels instead.
    gemv_all(w, a, y.data<float>(), ldy, isa);
    return;
  }
  if (w.scheme == QuantScheme::kW8A8) {
    // s8 x s8 through oneDNN's int8 GEMM (VNNI, or AMX-int8 where the CPU has it): exact
    // int32 sums, then each (token, channel) scaled by its two scales.
    GemmArgs g;
    g.m = M, g.n = w.out, g.k = w.in;
    g.a = a.xq.data(), g.a_dtype = DType::kI8, g.lda = w.in;
    g.b = w.q.data<int8_t>(), g.b_dtype = DType::kI8, g.ldb = w.in, g.trans_b = true;
    g.c = y.data<float>(), g.ldc = ldy;
    gemm_onednn(g);
    // (a is thread_local: the workers below must not name it.)
    const float* ws = w.scales.data<float>();
    const float* xscale = a.xscale.data();
    float* yd = y.data<float>();
    base::parallel_for(M, 4, [=](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m) {
        float* row = yd + m * ldy;
        const float xs = xscale[m];
        for (int64_t o = 0; o < w.out; ++o) row[o] *= xs * ws[o];
      }
    });
    return;
  }
  // Blocks of W small enough to stay in L2 once dequantized; bf16 where this CPU
  // multiplies bf16 natively faster (AMX), with x converted to bf16 once.
  const bool bf = bf16_native_gemm_faster();
  const DType dt = bf ? DType::kBF16 : DType::kF32;
  const int64_t nb = std::clamp<int64_t>((int64_t{2} << 20) / (w.in * 4) / 16 * 16, 64, 512);
  Tensor xs = !a.permuted ? x : Tensor::from_blob(a.scratch.data(), {M, w.in}, DType::kF32, nullptr);
  if (bf) xs = xs.to(DType::kBF16);
  Tensor block = Tensor::empty({std::min(nb, w.out), w.in}, dt);
  for (int64_t o0 = 0; o0 < w.out; o0 += nb) {
    const int64_t o1 = std::min(w.out, o0 + nb);
    Tensor blk = block.slice(0, 0, o1 - o0);
    dequantize_rows(w, o0, o1, blk);
    Tensor yb = y.slice(1, o0, o1);
    matmul(xs, blk, yb, false, true);
  }
}

}  // namespace tessera::kernels::cpu
