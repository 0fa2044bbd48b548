// Tile building blocks for CPU attention: a portable scalar table and an AVX-512 table
// (register-blocked GEMM micro-kernels, 16x16 transposes, vector exp).
#include "tessera/kernels/cpu/attention_tile_ops.h"
#include "tessera/kernels/cpu/transpose16.h"

#include "tessera/kernels/cpu/avx512_math.h"

// GCC 12 flags its own intrinsics (the _mm512_undefined_ps idiom) as uninitialised reads.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace tessera::kernels::cpu {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// ---------------------------------------------------------------------------------------
// Portable versions: plain loops the compiler may vectorise with the baseline ISA.

void gemm_scalar(int64_t M, int64_t N, int64_t K, const float* a, int64_t a_si, int64_t a_sk,
                 const float* b, int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  for (int64_t i = 0; i < M; ++i) {
    float* ci = c + i * ldc;
    if (!accumulate) std::fill_n(ci, N, 0.f);
    for (int64_t k = 0; k < K; ++k) {
      const float aik = a[i * a_si + k * a_sk];
      const float* bk = b + k * ldb;
      for (int64_t n = 0; n < N; ++n) ci[n] += aik * bk[n];
    }
  }
}

void pack_transposed_scalar(const float* src, int64_t src_ld, int64_t n, int64_t D, float* dst,
                            int64_t ld) {
  const int64_t padded = (n + 15) / 16 * 16;
  for (int64_t d = 0; d < D; ++d) {
    float* row = dst + d * ld;
    for (int64_t j = 0; j < n; ++j) row[j] = src[j * src_ld + d];
    for (int64_t j = n; j < padded; ++j) row[j] = 0.f;
  }
}

void softmax_update_scalar(float* s, int64_t lds, int64_t R, int64_t n, float* m, float* l,
                           float* o, int64_t ldo, int64_t D) {
  for (int64_t r = 0; r < R; ++r) {
    float* sr = s + r * lds;
    float mx = m[r];
    for (int64_t j = 0; j < n; ++j) mx = std::max(mx, sr[j]);
    if (mx == kNegInf) {  // nothing visible yet: keep l = 0, o = 0
      std::fill_n(sr, n, 0.f);
      continue;
    }
    const float alpha = std::exp(m[r] - mx);  // exp(-inf) = 0 on the first visible tile
    float sum = 0.f;
    for (int64_t j = 0; j < n; ++j) {
      sr[j] = std::exp(sr[j] - mx);
      sum += sr[j];
    }
    l[r] = l[r] * alpha + sum;
    m[r] = mx;
    if (alpha != 1.f) {
      float* orow = o + r * ldo;
      for (int64_t d = 0; d < D; ++d) orow[d] *= alpha;
    }
  }
}

void probs_from_scores_scalar(float* s, int64_t lds, int64_t R, int64_t n, const float* lse) {
  for (int64_t r = 0; r < R; ++r) {
    float* sr = s + r * lds;
    for (int64_t j = 0; j < n; ++j) sr[j] = std::exp(sr[j] - lse[r]);
  }
}

void dscores_from_dprobs_scalar(const float* p, float* dp, int64_t lds, int64_t R, int64_t n,
                                const float* delta) {
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < n; ++j) dp[r * lds + j] = p[r * lds + j] * (dp[r * lds + j] - delta[r]);
}

float dot_scalar(const float* a, const float* b, int64_t n) {
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// ---------------------------------------------------------------------------------------
// AVX-512 versions.

#define TESSERA_ATTN_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))

TESSERA_ATTN_AVX512 inline __mmask16 tail_mask(int64_t n) {
  return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1u);
}

// MR rows x NV vectors of C held in registers (MR * NV <= 24); the last vector is masked
// so any N works. Each k step loads NV vectors of B and broadcasts MR values of A.
template <int MR, int NV>
TESSERA_ATTN_AVX512 void gemm_micro(int64_t K, const float* a, int64_t a_si, int64_t a_sk,
                                    const float* b, int64_t ldb, float* c, int64_t ldc,
                                    __mmask16 last, bool accumulate) {
  __m512 acc[MR][NV];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v)
      acc[m][v] = accumulate ? _mm512_maskz_loadu_ps(v == NV - 1 ? last : __mmask16(0xFFFF),
                                                     c + m * ldc + v * 16)
                             : _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const float* bk = b + k * ldb;
    __m512 bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV - 1; ++v) bv[v] = _mm512_loadu_ps(bk + v * 16);
    bv[NV - 1] = _mm512_maskz_loadu_ps(last, bk + (NV - 1) * 16);
    const float* ak = a + k * a_sk;
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m512 av = _mm512_set1_ps(ak[m * a_si]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_fmadd_ps(av, bv[v], acc[m][v]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
#pragma GCC unroll 4
    for (int v = 0; v < NV - 1; ++v) _mm512_storeu_ps(c + m * ldc + v * 16, acc[m][v]);
    _mm512_mask_storeu_ps(c + m * ldc + (NV - 1) * 16, last, acc[m][NV - 1]);
  }
}

using MicroFn = void (*)(int64_t, const float*, int64_t, int64_t, const float*, int64_t, float*,
                         int64_t, __mmask16, bool);
constexpr int kMaxMR = 6;
constexpr int kMaxNV = 4;

template <int MR>
constexpr MicroFn micro_row(int nv) {
  return nv == 1   ? &gemm_micro<MR, 1>
         : nv == 2 ? &gemm_micro<MR, 2>
         : nv == 3 ? &gemm_micro<MR, 3>
                   : &gemm_micro<MR, 4>;
}

MicroFn micro_kernel(int mr, int nv) {
  static const MicroFn table[kMaxMR][kMaxNV] = {
      {micro_row<1>(1), micro_row<1>(2), micro_row<1>(3), micro_row<1>(4)},
      {micro_row<2>(1), micro_row<2>(2), micro_row<2>(3), micro_row<2>(4)},
      {micro_row<3>(1), micro_row<3>(2), micro_row<3>(3), micro_row<3>(4)},
      {micro_row<4>(1), micro_row<4>(2), micro_row<4>(3), micro_row<4>(4)},
      {micro_row<5>(1), micro_row<5>(2), micro_row<5>(3), micro_row<5>(4)},
      {micro_row<6>(1), micro_row<6>(2), micro_row<6>(3), micro_row<6>(4)},
  };
  return table[mr - 1][nv - 1];
}

TESSERA_ATTN_AVX512 void gemm_avx512(int64_t M, int64_t N, int64_t K, const float* a, int64_t a_si,
                                     int64_t a_sk, const float* b, int64_t ldb, float* c,
                                     int64_t ldc, bool accumulate) {
  for (int64_t n0 = 0; n0 < N; n0 += 16 * kMaxNV) {
    const int64_t nn = std::min<int64_t>(16 * kMaxNV, N - n0);
    const int nv = static_cast<int>((nn + 15) / 16);
    const __mmask16 last = tail_mask(nn - (nv - 1) * 16);
    for (int64_t m0 = 0; m0 < M; m0 += kMaxMR) {
      const int mr = static_cast<int>(std::min<int64_t>(kMaxMR, M - m0));
      micro_kernel(mr, nv)(K, a + m0 * a_si, a_si, a_sk, b + n0, ldb, c + m0 * ldc + n0, ldc, last,
                           accumulate);
    }
  }
}

// In-register 16x16 transpose: r[i] holds row i on entry and column i on exit.
TESSERA_ATTN_AVX512 void pack_transposed_avx512(const float* src, int64_t src_ld, int64_t n,
                                                int64_t D, float* dst, int64_t ld) {
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t jn = std::min<int64_t>(16, n - j0);
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
      const int64_t dn = std::min<int64_t>(16, D - d0);
      const __mmask16 mask = tail_mask(dn);
      __m512 r[16];
      for (int jj = 0; jj < 16; ++jj)
        r[jj] = jj < jn ? _mm512_maskz_loadu_ps(mask, src + (j0 + jj) * src_ld + d0)
                        : _mm512_setzero_ps();
      transpose16(r);
      for (int64_t dd = 0; dd < dn; ++dd) _mm512_storeu_ps(dst + (d0 + dd) * ld + j0, r[dd]);
    }
  }
}

TESSERA_ATTN_AVX512 inline __m512 exp512(__m512 x) { return avx512::exp_or_zero(x); }

TESSERA_ATTN_AVX512 void softmax_update_avx512(float* s, int64_t lds, int64_t R, int64_t n,
                                               float* m, float* l, float* o, int64_t ldo,
                                               int64_t D) {
  for (int64_t r = 0; r < R; ++r) {
    float* sr = s + r * lds;
    __m512 vmax = _mm512_set1_ps(m[r]);
    for (int64_t j = 0; j < n; j += 16)
      vmax = _mm512_mask_max_ps(vmax, tail_mask(n - j), vmax,
                                _mm512_maskz_loadu_ps(tail_mask(n - j), sr + j));
    const float mx = _mm512_reduce_max_ps(vmax);
    if (mx == kNegInf) {
      for (int64_t j = 0; j < n; j += 16)
        _mm512_mask_storeu_ps(sr + j, tail_mask(n - j), _mm512_setzero_ps());
      continue;
    }
    const float alpha = std::exp(m[r] - mx);
    const __m512 vm = _mm512_set1_ps(mx);
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 mk = tail_mask(n - j);
      const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, sr + j), vm));
      _mm512_mask_storeu_ps(sr + j, mk, e);
      vsum = _mm512_mask_add_ps(vsum, mk, vsum, e);
    }
    l[r] = l[r] * alpha + _mm512_reduce_add_ps(vsum);
    m[r] = mx;
    if (alpha != 1.f) {
      const __m512 va = _mm512_set1_ps(alpha);
      float* orow = o + r * ldo;
      for (int64_t d = 0; d < D; d += 16) {
        const __mmask16 mk = tail_mask(D - d);
        const __m512 ov = _mm512_maskz_loadu_ps(mk, orow + d);
        _mm512_mask_storeu_ps(orow + d, mk, _mm512_mul_ps(ov, va));
      }
    }
  }
}

TESSERA_ATTN_AVX512 void probs_from_scores_avx512(float* s, int64_t lds, int64_t R, int64_t n,
                                                  const float* lse) {
  for (int64_t r = 0; r < R; ++r) {
    float* sr = s + r * lds;
    const __m512 vl = _mm512_set1_ps(lse[r]);
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 mk = tail_mask(n - j);
      _mm512_mask_storeu_ps(sr + j, mk,
                            exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, sr + j), vl)));
    }
  }
}

TESSERA_ATTN_AVX512 void dscores_from_dprobs_avx512(const float* p, float* dp, int64_t lds,
                                                    int64_t R, int64_t n, const float* delta) {
  for (int64_t r = 0; r < R; ++r) {
    const __m512 vd = _mm512_set1_ps(delta[r]);
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 mk = tail_mask(n - j);
      const __m512 pv = _mm512_maskz_loadu_ps(mk, p + r * lds + j);
      const __m512 dv = _mm512_maskz_loadu_ps(mk, dp + r * lds + j);
      _mm512_mask_storeu_ps(dp + r * lds + j, mk, _mm512_mul_ps(pv, _mm512_sub_ps(dv, vd)));
    }
  }
}

TESSERA_ATTN_AVX512 float dot_avx512(const float* a, const float* b, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mk = tail_mask(n - i);
    const __m512 av = _mm512_maskz_loadu_ps(mk, a + i);
    acc = _mm512_fmadd_ps(av, _mm512_maskz_loadu_ps(mk, b + i), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

}  // namespace

const AttnTileOps& scalar_tile_ops() {
  static const AttnTileOps ops{gemm_scalar,
                               pack_transposed_scalar,
                               softmax_update_scalar,
                               probs_from_scores_scalar,
                               dscores_from_dprobs_scalar,
                               dot_scalar};
  return ops;
}

const AttnTileOps& avx512_tile_ops() {
  static const AttnTileOps ops{gemm_avx512,
                               pack_transposed_avx512,
                               softmax_update_avx512,
                               probs_from_scores_avx512,
                               dscores_from_dprobs_avx512,
                               dot_avx512};
  return ops;
}

}  // namespace tessera::kernels::cpu
