// The packer of kernels/packed_b.h: weights stored row-major in bf16 into oneDNN's
// BA16a64b2a blocked layout of the matmul's b operand, by stored rows.
// GCC 12 warns about its own _mm512_undefined_* placeholders (GCC PR 105593).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "tessera/kernels/cpu/matmul_cpu.h"
#include "tessera/kernels/dispatch.h"

#define TESSERA_TARGET_AVX512 __attribute__((target("avx512f,avx512bw")))

namespace tessera::kernels::cpu {

namespace {

constexpr int64_t kBlockK = 32, kBlockN = 64;

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// A whole 64-byte line of the packed copy. Streamed around the cache where aligned: the
// copy is read by the next products, long after, and a plain store would first read the
// line it overwrites.
TESSERA_TARGET_AVX512 inline void store_line(void* d, __m512i v) {
  if (reinterpret_cast<uintptr_t>(d) % 64 == 0)
    _mm512_stream_si512(static_cast<__m512i*>(d), v);
  else
    _mm512_storeu_si512(d, v);
}

// 16 rows' 16 pairs each (rows[i] + 2 p0) as 16 lines, one per pair, of the 16 rows'
// dwords: a 16 x 16 transpose of 32-bit values in registers.
TESSERA_TARGET_AVX512 void transpose_16_pairs(const uint16_t* const* rows, int64_t p0, uint32_t* const* lines) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(rows[i] + 2 * p0);
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // r[4q + j], 128-bit lane l: rows 4q..4q+3 at pair 4l + j.
  for (int q = 0; q < 4; ++q) {
    r[4 * q] = _mm512_unpacklo_epi64(t[4 * q], t[4 * q + 2]);
    r[4 * q + 1] = _mm512_unpackhi_epi64(t[4 * q], t[4 * q + 2]);
    r[4 * q + 2] = _mm512_unpacklo_epi64(t[4 * q + 1], t[4 * q + 3]);
    r[4 * q + 3] = _mm512_unpackhi_epi64(t[4 * q + 1], t[4 * q + 3]);
  }
  // Pair 4l + j gathers lane l of r[j], r[4 + j], r[8 + j], r[12 + j].
  for (int j = 0; j < 4; ++j) {
    const __m512i s0 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x44), s1 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xEE);
    const __m512i s2 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x44),
                  s3 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xEE);
    store_line(lines[j], _mm512_shuffle_i32x4(s0, s2, 0x88));
    store_line(lines[4 + j], _mm512_shuffle_i32x4(s0, s2, 0xDD));
    store_line(lines[8 + j], _mm512_shuffle_i32x4(s1, s3, 0x88));
    store_line(lines[12 + j], _mm512_shuffle_i32x4(s1, s3, 0xDD));
  }
}

// 16 columns of two rows interleaved: d[2 j] = a[j], d[2 j + 1] = b[j].
TESSERA_TARGET_AVX512 void interleave_16(const uint16_t* a, const uint16_t* b, uint16_t* d) {
  const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)));
  const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)));
  store_line(d, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
}

// Stored (N, K): a Linear weight (out, in) for x W^T. Rows are N; each row's K values
// go to pairs (k, k+1) that sit 64 pairs apart within a block. 16 whole rows starting at
// a multiple of 16 fill one 64-byte line per pair: those are written line by line.
void pack_trans_rows(const uint16_t* w, int64_t ld, int64_t r0, int64_t r1, int64_t k, uint16_t* dst) {
  const auto row = [&](int64_t r) { return w + (r - r0) * ld; };  // w is row r0
  const int64_t kp = round_up(k, kBlockK), pairs = k / 2;
  const bool avx512 = cpu_has(IsaLevel::kAvx512);
  int64_t r = r0;
  const auto one_row = [&](int64_t n) {
    const uint16_t* src = row(n);
    for (int64_t kk = 0; kk < k; ++kk) dst[packed_index(kk, n, kp)] = src[kk];
  };
  for (; r < r1 && r % 16 != 0; ++r) one_row(r);
  auto* d32 = reinterpret_cast<uint32_t*>(dst);
  for (; r + 16 <= r1; r += 16) {
    const uint16_t* rows[16];
    for (int i = 0; i < 16; ++i) rows[i] = row(r + i);
    uint32_t* base = d32 + (r / kBlockN) * (kp * kBlockN / 2) + (r % kBlockN);
    int64_t p = 0;
    if (avx512)
      for (; p + 16 <= pairs; p += 16) {
        uint32_t* lines[16];
        for (int j = 0; j < 16; ++j) lines[j] = base + (p >> 4) * (kBlockK * kBlockN / 2) + j * kBlockN;
        transpose_16_pairs(rows, p, lines);
      }
    for (; p < pairs; ++p) {
      uint32_t* line = base + (p >> 4) * (kBlockK * kBlockN / 2) + (p & 15) * kBlockN;
      for (int i = 0; i < 16; ++i) {
        uint32_t v;
        std::memcpy(&v, rows[i] + 2 * p, sizeof v);
        line[i] = v;
      }
    }
    if (k % 2)  // the last, unpaired k
      for (int i = 0; i < 16; ++i) dst[packed_index(k - 1, r + i, kp)] = rows[i][k - 1];
  }
  for (; r < r1; ++r) one_row(r);
}

// Stored (K, N): rows are K. Two rows k, k+1 (k even) interleave into 128 contiguous
// values per 64 columns.
void pack_plain_rows(const uint16_t* w, int64_t ld, int64_t r0, int64_t r1, int64_t k, int64_t n,
                     uint16_t* dst) {
  const auto row = [&](int64_t r) { return w + (r - r0) * ld; };  // w is row r0
  const int64_t kp = round_up(k, kBlockK);
  const bool avx512 = cpu_has(IsaLevel::kAvx512);
  int64_t r = r0;
  const auto one_row = [&](int64_t kk) {
    const uint16_t* src = row(kk);
    for (int64_t j = 0; j < n; ++j) dst[packed_index(kk, j, kp)] = src[j];
  };
  if (r < r1 && r % 2) one_row(r++);
  for (; r + 2 <= r1; r += 2) {
    const uint16_t* a = row(r);
    const uint16_t* b = a + ld;
    for (int64_t j0 = 0; j0 < n; j0 += kBlockN) {
      uint16_t* d = dst + packed_index(r, j0, kp);
      const int64_t cols = std::min(kBlockN, n - j0);
      int64_t j = 0;
      if (avx512)
        for (; j + 16 <= cols; j += 16) interleave_16(a + j0 + j, b + j0 + j, d + 2 * j);
      for (; j < cols; ++j) {
        d[2 * j] = a[j0 + j];
        d[2 * j + 1] = b[j0 + j];
      }
    }
  }
  if (r < r1) one_row(r);
}

}  // namespace

int64_t packed_index(int64_t kk, int64_t nn, int64_t kp) {
  return (nn / kBlockN) * (kp * kBlockN) + (kk / kBlockK) * (kBlockK * kBlockN) +
         ((kk % kBlockK) / 2) * (2 * kBlockN) + (nn % kBlockN) * 2 + (kk % 2);
}

int64_t packed_elements(int64_t k, int64_t n) { return round_up(k, kBlockK) * round_up(n, kBlockN); }

void pack_rows(const uint16_t* w, int64_t ld, int64_t r0, int64_t r1, int64_t k, int64_t n, bool trans,
               uint16_t* dst) {
  if (r0 >= r1) return;
  if (trans)
    pack_trans_rows(w, ld, r0, r1, k, dst);
  else
    pack_plain_rows(w, ld, r0, r1, k, n, dst);
  if (cpu_has(IsaLevel::kAvx512)) _mm_sfence();  // the streamed lines before anyone reads them
}

void pack_elements(const uint16_t* w, int64_t e0, int64_t e1, int64_t cols, int64_t k, bool trans, uint16_t* dst) {
  const int64_t kp = round_up(k, kBlockK);
  for (int64_t e = e0; e < e1; ++e) {
    const int64_t r = e / cols, c = e % cols;
    dst[trans ? packed_index(c, r, kp) : packed_index(r, c, kp)] = w[e - e0];
  }
}

}  // namespace tessera::kernels::cpu
