// Skinny GEMM for decode: c(M small, N) = a(M, K) @ b(N, K)^T with a bf16 or f32
// weight b. The product is bound by reading b once from memory, so each weight row
// is widened to f32 in registers (bf16 -> f32 is a 16-bit shift, exact) and FMA'd
// against f32 activations; a is kept in f32, which is more accurate than rounding it
// to bf16 for vdpbf16ps and costs nothing at this arithmetic intensity.
// GCC 12 warns about its own _mm512_undefined_* placeholders inside the intrinsics
// headers (GCC PR 105593); the warnings are false positives.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "tessera/kernels/dispatch.h"
#include "tessera/base/cpu_features.h"
#include "tessera/base/error.h"
#include "tessera/base/thread_pool.h"
#include "tessera/kernels/cpu/avx2_math.h"
#include "tessera/kernels/cpu/matmul_cpu.h"

#define TESSERA_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))

namespace tessera::kernels::cpu {
namespace {

// Up to 4 rows of op(a) in f32, row stride lda; c points at the matching rows of c.
struct Panel {
  const float* a;  // (mb, k)
  int64_t lda;
  const void* b;  // (n, k), row stride ldb, bf16 (uint16_t) or f32
  int64_t ldb;
  int64_t k;
  float* c;  // (mb, n), row stride ldc
  int64_t ldc;
  float alpha;
  float beta;
};

// beta == 0 must not read c: it may be uninitialised (NaN * 0 is NaN).
inline void store_c(float* c, float acc, float alpha, float beta) {
  *c = beta == 0.f ? alpha * acc : alpha * acc + beta * *c;
}

inline float load_scalar(const float* p) { return *p; }
inline float load_scalar(const uint16_t* p) { return bf16_to_f32(*p); }

// ---- AVX-512 -------------------------------------------------------------------------

TESSERA_TARGET_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
TESSERA_TARGET_AVX512 inline __m512 load16(const uint16_t* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
TESSERA_TARGET_AVX512 inline __m512 load16_masked(const float* p, __mmask16 m) {
  return _mm512_maskz_loadu_ps(m, p);
}
TESSERA_TARGET_AVX512 inline __m512 load16_masked(const uint16_t* p, __mmask16 m) {
  const __m256i raw = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// NR rows of b starting at `b` against MB rows of a; writes c[m][0..NR).
template <int MB, int NR, typename BT>
TESSERA_TARGET_AVX512 void block_avx512(const Panel& p, const BT* b, float* c) {
  __m512 acc[NR][MB];
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_setzero_ps();
  const int64_t k = p.k;
  int64_t kk = 0;
  for (; kk + 16 <= k; kk += 16) {
    // The next NR rows into L2, one line per row per step, as block_avx512_bf16 does:
    // without it the hardware streamer does not run far enough ahead, and from 4 rows
    // of a the FMAs and the memory stalls add up instead of overlapping (Zen 4, 2 cores:
    // a 4096 x 768 product of 4 rows 0.59-0.71 ms without, 0.42-0.50 with; 1 row
    // 0.47-0.56 against 0.42-0.48).
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r)
      _mm_prefetch(reinterpret_cast<const char*>(b + (r + NR) * p.ldb + kk), _MM_HINT_T1);
    __m512 av[MB];
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) av[m] = _mm512_loadu_ps(p.a + m * p.lda + kk);
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      const __m512 bv = load16(b + r * p.ldb + kk);
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_fmadd_ps(av[m], bv, acc[r][m]);
    }
  }
  if (kk < k) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (k - kk)) - 1);
    __m512 av[MB];
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) av[m] = _mm512_maskz_loadu_ps(mask, p.a + m * p.lda + kk);
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      const __m512 bv = load16_masked(b + r * p.ldb + kk, mask);
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_fmadd_ps(av[m], bv, acc[r][m]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m)
      store_c(c + m * p.ldc + r, _mm512_reduce_add_ps(acc[r][m]), p.alpha, p.beta);
}

// bf16 weights: one 64-byte load gives 32 bf16; shifting each 32-bit lane left by 16
// yields the even elements as f32 and masking the low half yields the odd ones, so no
// cross-lane widening (port-5 shuffles) is needed. `p.a` is deinterleaved to match:
// per 32 elements of K, 16 even then 16 odd, zero-padded to a multiple of 32.
template <int MB, int NR>
TESSERA_TARGET_AVX512 void block_avx512_bf16(const Panel& p, const uint16_t* b, float* c) {
  __m512 acc[NR][MB];
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
    for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_setzero_ps();
  const __m512i hi_mask = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  const int64_t k = p.k;
  for (int64_t kk = 0; kk < k; kk += 32) {
    // The next NR rows into L2. A bf16 row of a typical K is one 4 KiB page, and the
    // hardware streamer retrains at every page, which cost ~15% of DRAM bandwidth;
    // prefetching the next block keeps the stream going (measured +15-25% cold, -7%
    // when b sits in L3). Prefetches past the last row are harmless: they never fault.
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r)
      _mm_prefetch(reinterpret_cast<const char*>(b + (r + NR) * p.ldb + kk), _MM_HINT_T1);
    __m512 ae[MB], ao[MB];
#pragma GCC unroll 4
    for (int m = 0; m < MB; ++m) {
      ae[m] = _mm512_loadu_ps(p.a + m * p.lda + kk);
      ao[m] = _mm512_loadu_ps(p.a + m * p.lda + kk + 16);
    }
    const __mmask32 mask = k - kk >= 32 ? ~__mmask32{0} : (__mmask32{1} << (k - kk)) - 1;
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      const __m512i x = _mm512_maskz_loadu_epi16(mask, b + r * p.ldb + kk);
      const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
      const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(x, hi_mask));
#pragma GCC unroll 4
      for (int m = 0; m < MB; ++m) {
        acc[r][m] = _mm512_fmadd_ps(ae[m], even, acc[r][m]);
        acc[r][m] = _mm512_fmadd_ps(ao[m], odd, acc[r][m]);
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
    for (int m = 0; m < MB; ++m)
      store_c(c + m * p.ldc + r, _mm512_reduce_add_ps(acc[r][m]), p.alpha, p.beta);
}

// 5-8 rows of a against f32 weights in one pass, 2 weight rows at a time (MB * 2
// accumulators, MB a vectors): each weight line is loaded once for every row of a, where two
// passes of 4 rows load it twice (the second time from L2). Only while a's rows stay in L1
// (kWideRowsBytes): K = 768 at 8 rows (24 KiB) runs 1.2-1.3x faster than two passes of 4 on
// Zen 4; K = 2048 at 8 rows (64 KiB) ran 1.7-2x slower, a's loads missing L1.
constexpr int64_t kWideRowsBytes = 24 << 10;

template <int MB>
TESSERA_TARGET_AVX512 void wide_rows_avx512(const Panel& p, int64_t n0, int64_t n1) {
  static_assert(MB > 4 && MB <= 8);
  const float* b = static_cast<const float*>(p.b);
  int64_t n = n0;
  for (; n + 2 <= n1; n += 2) block_avx512<MB, 2>(p, b + n * p.ldb, p.c + n);
  for (; n < n1; ++n) block_avx512<MB, 1>(p, b + n * p.ldb, p.c + n);
}

template <int MB, typename BT>
TESSERA_TARGET_AVX512 void rows_avx512(const Panel& p, int64_t n0, int64_t n1) {
  const BT* b = static_cast<const BT*>(p.b);
  if constexpr (std::is_same_v<BT, uint16_t>) {
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) block_avx512_bf16<MB, 4>(p, b + n * p.ldb, p.c + n);
    for (; n < n1; ++n) block_avx512_bf16<MB, 1>(p, b + n * p.ldb, p.c + n);
    return;
  }
  int64_t n = n0;
  // 4 weight rows per pass: a's vectors are loaded once for 4 rows, and MB * 4
  // independent accumulators hide the FMA latency even when MB == 1.
  for (; n + 4 <= n1; n += 4) block_avx512<MB, 4>(p, b + n * p.ldb, p.c + n);
  for (; n < n1; ++n) block_avx512<MB, 1>(p, b + n * p.ldb, p.c + n);
}

// ---- AVX2 ----------------------------------------------------------------------------

TESSERA_AVX2_FMA inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
TESSERA_AVX2_FMA inline __m256 load8(const uint16_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
using avx2::hsum8;

// Eight columns of K from kk: acc[r][m] += a[m][kk..kk+8) * b[r][kk..kk+8).
template <int MB, int NR, typename BT>
TESSERA_AVX2_FMA inline void step8(const Panel& p, const BT* b, int64_t kk, __m256 (&acc)[NR][MB]) {
  __m256 av[MB];
#pragma GCC unroll 4
  for (int m = 0; m < MB; ++m) av[m] = _mm256_loadu_ps(p.a + m * p.lda + kk);
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r) {
    const __m256 bv = load8(b + r * p.ldb + kk);
#pragma GCC unroll 4
    for (int m = 0; m < MB; ++m) acc[r][m] = _mm256_fmadd_ps(av[m], bv, acc[r][m]);
  }
}

// 16 ymm registers: 2 weight rows x 4 a rows of accumulators + 4 a vectors + 1 b.
template <int MB, int NR, typename BT>
TESSERA_AVX2_FMA void block_avx2(const Panel& p, const BT* b, float* c) {
  __m256 acc[NR][MB];
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
    for (int m = 0; m < MB; ++m) acc[r][m] = _mm256_setzero_ps();
  const int64_t k = p.k;
  int64_t kk = 0;
  for (; kk + 16 <= k; kk += 16) {
    // The next NR rows into L2, as block_avx512 does (Zen 3, 2 cores, one row of a: bf16
    // weights read at 15-17 GB/s without, 19-22 with; performance.md, "Decode on an
    // AVX2-only CPU").
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r)
      _mm_prefetch(reinterpret_cast<const char*>(b + (r + NR) * p.ldb + kk), _MM_HINT_T1);
    step8<MB, NR>(p, b, kk, acc);
    step8<MB, NR>(p, b, kk + 8, acc);
  }
  for (; kk + 8 <= k; kk += 8) step8<MB, NR>(p, b, kk, acc);
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
    for (int m = 0; m < MB; ++m) {
      float s = hsum8(acc[r][m]);
      for (int64_t t = kk; t < k; ++t) s += p.a[m * p.lda + t] * load_scalar(b + r * p.ldb + t);
      store_c(c + m * p.ldc + r, s, p.alpha, p.beta);
    }
}

template <int MB, typename BT>
TESSERA_AVX2_FMA void rows_avx2(const Panel& p, int64_t n0, int64_t n1) {
  const BT* b = static_cast<const BT*>(p.b);
  int64_t n = n0;
  for (; n + 2 <= n1; n += 2) block_avx2<MB, 2>(p, b + n * p.ldb, p.c + n);
  for (; n < n1; ++n) block_avx2<MB, 1>(p, b + n * p.ldb, p.c + n);
}

// ---- Portable ------------------------------------------------------------------------

template <int MB, typename BT>
void rows_scalar(const Panel& p, int64_t n0, int64_t n1) {
  const BT* b = static_cast<const BT*>(p.b);
  for (int64_t n = n0; n < n1; ++n) {
    const BT* row = b + n * p.ldb;
    float acc[MB] = {};
    for (int64_t t = 0; t < p.k; ++t) {
      const float bv = load_scalar(row + t);
      for (int m = 0; m < MB; ++m) acc[m] += p.a[m * p.lda + t] * bv;
    }
    for (int m = 0; m < MB; ++m) store_c(p.c + m * p.ldc + n, acc[m], p.alpha, p.beta);
  }
}

// ---- Dispatch ------------------------------------------------------------------------

template <int MB, typename BT>
void run_rows(SkinnyIsa isa, const Panel& p, int64_t n0, int64_t n1) {
  switch (isa) {
    case SkinnyIsa::kAvx512: rows_avx512<MB, BT>(p, n0, n1); break;
    case SkinnyIsa::kAvx2: rows_avx2<MB, BT>(p, n0, n1); break;
    default: rows_scalar<MB, BT>(p, n0, n1); break;
  }
}

template <typename BT>
void run_rows(SkinnyIsa isa, int mb, const Panel& p, int64_t n0, int64_t n1) {
  if constexpr (std::is_same_v<BT, float>) {  // one pass of 5-8 rows: AVX-512, f32 weights
    if (isa == SkinnyIsa::kAvx512) switch (mb) {
      case 5: return wide_rows_avx512<5>(p, n0, n1);
      case 6: return wide_rows_avx512<6>(p, n0, n1);
      case 7: return wide_rows_avx512<7>(p, n0, n1);
      case 8: return wide_rows_avx512<8>(p, n0, n1);
      default: break;
    }
  }
  switch (mb) {
    case 1: run_rows<1, BT>(isa, p, n0, n1); break;
    case 2: run_rows<2, BT>(isa, p, n0, n1); break;
    case 3: run_rows<3, BT>(isa, p, n0, n1); break;
    default: run_rows<4, BT>(isa, p, n0, n1); break;
  }
}

SkinnyIsa resolve(SkinnyIsa isa) {
  if (isa != SkinnyIsa::kBest) return isa;
  if (skinny_isa_supported(SkinnyIsa::kAvx512)) return SkinnyIsa::kAvx512;
  if (skinny_isa_supported(SkinnyIsa::kAvx2)) return SkinnyIsa::kAvx2;
  return SkinnyIsa::kScalar;
}

}  // namespace

bool skinny_isa_supported(SkinnyIsa isa) {
  switch (isa) {  // the kernels' one ISA level (dispatch.h)
    case SkinnyIsa::kAvx512: return cpu_has(IsaLevel::kAvx512);
    case SkinnyIsa::kAvx2: return cpu_has(IsaLevel::kAvx2);
    default: return true;
  }
}

void gemm_skinny(const GemmArgs& g, SkinnyIsa isa) {
  TESSERA_CHECK(g.trans_b, "matmul (skinny): needs trans_b, b as an (N, K) weight");
  TESSERA_CHECK(g.b_dtype == DType::kF32 || g.b_dtype == DType::kBF16,
                "matmul (skinny): b must be f32 or bf16, got ", dtype_name(g.b_dtype));
  isa = resolve(isa);
  TESSERA_CHECK(skinny_isa_supported(isa), "matmul (skinny): the requested ISA is not "
                "supported by this CPU (", base::describe_cpu_features(), ")");
  if (g.m == 0 || g.n == 0) return;

  // op(a) as f32 rows. Copying is M*K elements against N*K for b, so it is free;
  // the scratch only grows, so steady-state decode does not allocate.
  auto a_at = [&](int64_t m, int64_t t) {
    const int64_t i = g.trans_a ? t * g.lda + m : m * g.lda + t;
    return g.a_dtype == DType::kF32 ? static_cast<const float*>(g.a)[i]
                                    : bf16_to_f32(static_cast<const uint16_t*>(g.a)[i]);
  };
  const float* a = static_cast<const float*>(g.a);
  int64_t lda = g.lda;
  thread_local std::vector<float> scratch;
  if (isa == SkinnyIsa::kAvx512 && g.b_dtype == DType::kBF16) {
    // Deinterleaved for block_avx512_bf16: per 32 of K, the 16 even then the 16 odd.
    lda = (g.k + 31) / 32 * 32;
    if (scratch.size() < static_cast<size_t>(g.m * lda)) scratch.resize(g.m * lda);
    for (int64_t m = 0; m < g.m; ++m)
      for (int64_t t = 0; t < lda; ++t) {
        const int64_t base = t / 32 * 32, j = t % 32;
        const int64_t src = base + (j < 16 ? 2 * j : 2 * (j - 16) + 1);
        scratch[m * lda + t] = src < g.k ? a_at(m, src) : 0.f;
      }
    a = scratch.data();
  } else if (g.a_dtype != DType::kF32 || g.trans_a) {
    lda = g.k;
    if (scratch.size() < static_cast<size_t>(g.m * lda)) scratch.resize(g.m * lda);
    for (int64_t m = 0; m < g.m; ++m)
      for (int64_t t = 0; t < g.k; ++t) scratch[m * lda + t] = a_at(m, t);
    a = scratch.data();
  }

  const int64_t row_bytes = std::max<int64_t>(1, g.k * static_cast<int64_t>(dtype_size(g.b_dtype)));
  // At least ~32 KiB of weights per worker, so tiny products do not pay for a fork.
  const int64_t grain = std::max<int64_t>(4, (32 << 10) / row_bytes);
  // More than 4 rows of a (matmul's own choice stops at skinny_max_rows: 8 in decode steps)
  // pass over b in groups of 4, one block of weight rows at a time (256 KiB: it stays in L2
  // between the groups), so b is read from memory once. One group: the whole range at once.
  // 5-8 rows of f32 weights whose a fits L1 take one pass instead (wide_rows_avx512).
  const bool wide = isa == SkinnyIsa::kAvx512 && g.b_dtype == DType::kF32 && g.m > 4 && g.m <= 8 &&
                    g.m * g.k * static_cast<int64_t>(sizeof(float)) <= kWideRowsBytes;
  const int64_t group = wide ? g.m : 4;
  const int64_t block = g.m > group ? std::max<int64_t>(16, (256 << 10) / row_bytes) : g.n;
  base::parallel_for(g.n, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t b0 = n0; b0 < n1; b0 += block) {
      const int64_t b1 = std::min(n1, b0 + block);
      for (int64_t m0 = 0; m0 < g.m; m0 += group) {
        const int mb = static_cast<int>(std::min<int64_t>(group, g.m - m0));
        const Panel p{a + m0 * lda, lda, g.b, g.ldb, g.k, g.c + m0 * g.ldc, g.ldc, g.alpha, g.beta};
        if (g.b_dtype == DType::kBF16)
          run_rows<uint16_t>(isa, mb, p, b0, b1);
        else
          run_rows<float>(isa, mb, p, b0, b1);
      }
    }
  });
}

}  // namespace tessera::kernels::cpu
