// The attention tile table for AVX2 + FMA CPUs (no AVX-512: AMD Zen 1-3, Intel before
// Skylake-SP and the client cores without it): register-blocked GEMM micro-kernels of 8-lane
// vectors, 8x8 transposes, and avx2::exp_or_zero. The last vector of a row is read and
// written through vmaskmovps, so every lane of a tile runs the same arithmetic wherever the
// tile's edge falls (a key's probability has the same bits in a chunked prefill as in a
// whole one).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "tessera/kernels/cpu/attention_tile_ops.h"
#include "tessera/kernels/cpu/avx2_math.h"

namespace tessera::kernels::cpu {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// MR rows x NV vectors of C held in registers (MR * NV + NV + 1 <= 16 ymm registers); the
// last vector is masked so any N works. Each k step loads NV vectors of B and broadcasts
// MR values of A.
template <int MR, int NV>
TESSERA_AVX2_FMA void gemm_micro(int64_t K, const float* a, int64_t a_si, int64_t a_sk, const float* b,
                                 int64_t ldb, float* c, int64_t ldc, __m256i last, bool accumulate) {
  const __m256i all = _mm256_set1_epi32(-1);  // (not a global: its initializer would run AVX)
  __m256 acc[MR][NV];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v)
      acc[m][v] = accumulate ? _mm256_maskload_ps(c + m * ldc + v * 8, v == NV - 1 ? last : all)
                             : _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const float* bk = b + k * ldb;
    __m256 bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV - 1; ++v) bv[v] = _mm256_loadu_ps(bk + v * 8);
    bv[NV - 1] = _mm256_maskload_ps(bk + (NV - 1) * 8, last);
    const float* ak = a + k * a_sk;
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m256 av = _mm256_broadcast_ss(ak + m * a_si);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[m][v] = _mm256_fmadd_ps(av, bv[v], acc[m][v]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
#pragma GCC unroll 4
    for (int v = 0; v < NV - 1; ++v) _mm256_storeu_ps(c + m * ldc + v * 8, acc[m][v]);
    _mm256_maskstore_ps(c + m * ldc + (NV - 1) * 8, last, acc[m][NV - 1]);
  }
}

using MicroFn = void (*)(int64_t, const float*, int64_t, int64_t, const float*, int64_t, float*, int64_t,
                         __m256i, bool);
constexpr int kMaxMR = 6;
constexpr int kMaxNV = 2;

MicroFn micro_kernel(int mr, int nv) {
  static const MicroFn table[kMaxMR][kMaxNV] = {
      {&gemm_micro<1, 1>, &gemm_micro<1, 2>}, {&gemm_micro<2, 1>, &gemm_micro<2, 2>},
      {&gemm_micro<3, 1>, &gemm_micro<3, 2>}, {&gemm_micro<4, 1>, &gemm_micro<4, 2>},
      {&gemm_micro<5, 1>, &gemm_micro<5, 2>}, {&gemm_micro<6, 1>, &gemm_micro<6, 2>},
  };
  return table[mr - 1][nv - 1];
}

TESSERA_AVX2_FMA void gemm_avx2(int64_t M, int64_t N, int64_t K, const float* a, int64_t a_si, int64_t a_sk,
                                const float* b, int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  for (int64_t n0 = 0; n0 < N; n0 += 8 * kMaxNV) {
    const int64_t nn = std::min<int64_t>(8 * kMaxNV, N - n0);
    const int nv = static_cast<int>((nn + 7) / 8);
    const __m256i last = avx2::tail_mask(nn - (nv - 1) * 8);
    for (int64_t m0 = 0; m0 < M; m0 += kMaxMR) {
      const int mr = static_cast<int>(std::min<int64_t>(kMaxMR, M - m0));
      micro_kernel(mr, nv)(K, a + m0 * a_si, a_si, a_sk, b + n0, ldb, c + m0 * ldc + n0, ldc, last, accumulate);
    }
  }
}

// r[i] holds row i on entry and column i on exit.
TESSERA_AVX2_FMA inline void transpose8(__m256 r[8]) {
  __m256 t[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  __m256 u[8];
  for (int i = 0; i < 2; ++i) {
    u[4 * i + 0] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

TESSERA_AVX2_FMA void pack_transposed_avx2(const float* src, int64_t src_ld, int64_t n, int64_t D, float* dst,
                                           int64_t ld) {
  const int64_t padded = (n + 15) / 16 * 16;
  for (int64_t j0 = 0; j0 < padded; j0 += 8) {
    const int64_t jn = std::clamp<int64_t>(n - j0, 0, 8);
    for (int64_t d0 = 0; d0 < D; d0 += 8) {
      const int64_t dn = std::min<int64_t>(8, D - d0);
      const __m256i mask = avx2::tail_mask(dn);
      __m256 r[8];
      for (int jj = 0; jj < 8; ++jj)
        r[jj] = jj < jn ? _mm256_maskload_ps(src + (j0 + jj) * src_ld + d0, mask) : _mm256_setzero_ps();
      transpose8(r);
      for (int64_t dd = 0; dd < dn; ++dd) _mm256_storeu_ps(dst + (d0 + dd) * ld + j0, r[dd]);
    }
  }
}

TESSERA_AVX2_FMA void softmax_update_avx2(float* s, int64_t lds, int64_t R, int64_t n, float* m, float* l,
                                          float* o, int64_t ldo, int64_t D) {
  const __m256 ninf = _mm256_set1_ps(kNegInf);
  for (int64_t r = 0; r < R; ++r) {
    float* sr = s + r * lds;
    __m256 vmax = _mm256_set1_ps(m[r]);
    for (int64_t j = 0; j < n; j += 8) {
      const __m256i mk = avx2::tail_mask(n - j);
      const __m256 v = _mm256_blendv_ps(ninf, _mm256_maskload_ps(sr + j, mk), _mm256_castsi256_ps(mk));
      vmax = _mm256_max_ps(vmax, v);
    }
    const float mx = avx2::hmax8(vmax);
    if (mx == kNegInf) {  // nothing visible yet: keep l = 0, o = 0
      for (int64_t j = 0; j < n; j += 8) _mm256_maskstore_ps(sr + j, avx2::tail_mask(n - j), _mm256_setzero_ps());
      continue;
    }
    const float alpha = std::exp(m[r] - mx);  // exp(-inf) = 0 on the first visible tile
    const __m256 vm = _mm256_set1_ps(mx);
    __m256 vsum = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; j += 8) {
      const __m256i mk = avx2::tail_mask(n - j);
      const __m256 e = _mm256_and_ps(avx2::exp_or_zero(_mm256_sub_ps(_mm256_maskload_ps(sr + j, mk), vm)),
                                     _mm256_castsi256_ps(mk));
      _mm256_maskstore_ps(sr + j, mk, e);
      vsum = _mm256_add_ps(vsum, e);
    }
    l[r] = l[r] * alpha + avx2::hsum8(vsum);
    m[r] = mx;
    if (alpha != 1.f) {
      const __m256 va = _mm256_set1_ps(alpha);
      float* orow = o + r * ldo;
      for (int64_t d = 0; d < D; d += 8) {
        const __m256i mk = avx2::tail_mask(D - d);
        _mm256_maskstore_ps(orow + d, mk, _mm256_mul_ps(_mm256_maskload_ps(orow + d, mk), va));
      }
    }
  }
}

TESSERA_AVX2_FMA void probs_from_scores_avx2(float* s, int64_t lds, int64_t R, int64_t n, const float* lse) {
  for (int64_t r = 0; r < R; ++r) {
    float* sr = s + r * lds;
    const __m256 vl = _mm256_set1_ps(lse[r]);
    for (int64_t j = 0; j < n; j += 8) {
      const __m256i mk = avx2::tail_mask(n - j);
      _mm256_maskstore_ps(sr + j, mk, avx2::exp_or_zero(_mm256_sub_ps(_mm256_maskload_ps(sr + j, mk), vl)));
    }
  }
}

TESSERA_AVX2_FMA void dscores_from_dprobs_avx2(const float* p, float* dp, int64_t lds, int64_t R, int64_t n,
                                               const float* delta) {
  for (int64_t r = 0; r < R; ++r) {
    const __m256 vd = _mm256_set1_ps(delta[r]);
    for (int64_t j = 0; j < n; j += 8) {
      const __m256i mk = avx2::tail_mask(n - j);
      const __m256 pv = _mm256_maskload_ps(p + r * lds + j, mk);
      const __m256 dv = _mm256_maskload_ps(dp + r * lds + j, mk);
      _mm256_maskstore_ps(dp + r * lds + j, mk, _mm256_mul_ps(pv, _mm256_sub_ps(dv, vd)));
    }
  }
}

TESSERA_AVX2_FMA float dot_avx2(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    const __m256i mk = avx2::tail_mask(n - i);
    acc = _mm256_fmadd_ps(_mm256_maskload_ps(a + i, mk), _mm256_maskload_ps(b + i, mk), acc);
  }
  return avx2::hsum8(acc);
}

}  // namespace

const AttnTileOps& avx2_tile_ops() {
  static const AttnTileOps ops{gemm_avx2,
                               pack_transposed_avx2,
                               softmax_update_avx2,
                               probs_from_scores_avx2,
                               dscores_from_dprobs_avx2,
                               dot_avx2};
  return ops;
}

}  // namespace tessera::kernels::cpu
