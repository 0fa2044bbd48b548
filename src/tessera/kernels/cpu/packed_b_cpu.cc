// The packer of kernels/packed_b.h: weights stored row-major in bf16 into oneDNN's
// BA16a64b2a blocked layout of the matmul's b operand, by stored rows.
#include <algorithm>
#include <cstring>

#include "tessera/kernels/cpu/matmul_cpu.h"

namespace tessera::kernels::cpu {

namespace {

constexpr int64_t kBlockK = 32, kBlockN = 64;

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Stored (N, K): a Linear weight (out, in) for x W^T. Rows are N; each row's K values
// go to pairs (k, k+1) that sit 64 pairs apart within a block. 16 whole rows starting at
// a multiple of 16 fill one 64-byte line per pair: those are written line by line.
void pack_trans_rows(const uint16_t* w, int64_t ld, int64_t r0, int64_t r1, int64_t k, uint16_t* dst) {
  const int64_t kp = round_up(k, kBlockK), pairs = k / 2;
  int64_t r = r0;
  const auto one_row = [&](int64_t n) {
    const uint16_t* src = w + n * ld;
    for (int64_t kk = 0; kk < k; ++kk) dst[packed_index(kk, n, kp)] = src[kk];
  };
  for (; r < r1 && r % 16 != 0; ++r) one_row(r);
  auto* d32 = reinterpret_cast<uint32_t*>(dst);
  for (; r + 16 <= r1; r += 16) {
    const uint16_t* rows[16];
    for (int i = 0; i < 16; ++i) rows[i] = w + (r + i) * ld;
    uint32_t* base = d32 + (r / kBlockN) * (kp * kBlockN / 2) + (r % kBlockN);
    for (int64_t p = 0; p < pairs; ++p) {
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
  const int64_t kp = round_up(k, kBlockK);
  int64_t r = r0;
  const auto one_row = [&](int64_t kk) {
    const uint16_t* src = w + kk * ld;
    for (int64_t j = 0; j < n; ++j) dst[packed_index(kk, j, kp)] = src[j];
  };
  if (r < r1 && r % 2) one_row(r++);
  for (; r + 2 <= r1; r += 2) {
    const uint16_t* a = w + r * ld;
    const uint16_t* b = a + ld;
    for (int64_t j0 = 0; j0 < n; j0 += kBlockN) {
      uint16_t* d = dst + packed_index(r, j0, kp);
      const int64_t cols = std::min(kBlockN, n - j0);
      for (int64_t j = 0; j < cols; ++j) {
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
  if (trans)
    pack_trans_rows(w, ld, r0, r1, k, dst);
  else
    pack_plain_rows(w, ld, r0, r1, k, n, dst);
}

}  // namespace tessera::kernels::cpu
