// AMX-BF16 tile products and their packings (amx_tiles.h).
// GCC 12 warns about its own _mm512_undefined_* placeholders (GCC PR 105593).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include "tessera/kernels/cpu/amx_tiles.h"
#include "tessera/kernels/cpu/transpose16.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "tessera/base/error.h"
#include "tessera/tensor/bf16_avx512.h"
#include "tessera/tensor/dtype.h"

namespace tessera::kernels::cpu {
namespace {

#define TESSERA_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl")))

// Tiles 0-3: c (16 rows x 16 f32); 4-5: a (16 rows x 32 bf16); 6-7: b (16 pair rows x 16 pairs).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

TileConfig make_config() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  return cfg;
}

// From static storage: _tile_loadconfig's asm names only the first 8 bytes of its operand,
// so a stack copy's other stores may be dropped as dead.
TESSERA_AMX void load_config() {
  static const TileConfig config = make_config();
  _tile_loadconfig(&config);
}

// One (16 MI) x (16 NJ) block of c.
template <int MI, int NJ>
TESSERA_AMX void block(int64_t K, const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, float* c,
                       int64_t ldc, bool accumulate) {
  const int64_t sa = lda * 2, sb = ldb * 2, sc = ldc * 4;
  if (accumulate) {
    _tile_loadd(0, c, sc);
    if (NJ > 1) _tile_loadd(1, c + 16, sc);
    if (MI > 1) _tile_loadd(2, c + 16 * ldc, sc);
    if (MI > 1 && NJ > 1) _tile_loadd(3, c + 16 * ldc + 16, sc);
  } else {
    _tile_zero(0);
    if (NJ > 1) _tile_zero(1);
    if (MI > 1) _tile_zero(2);
    if (MI > 1 && NJ > 1) _tile_zero(3);
  }
  for (int64_t k = 0; k < K; k += 32) {
    _tile_loadd(4, a + k, sa);
    if (MI > 1) _tile_loadd(5, a + 16 * lda + k, sa);
    _tile_loadd(6, b + (k / 2) * ldb, sb);
    if (NJ > 1) _tile_loadd(7, b + (k / 2) * ldb + 32, sb);
    _tile_dpbf16ps(0, 4, 6);
    if (NJ > 1) _tile_dpbf16ps(1, 4, 7);
    if (MI > 1) _tile_dpbf16ps(2, 5, 6);
    if (MI > 1 && NJ > 1) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, sc);
  if (NJ > 1) _tile_stored(1, c + 16, sc);
  if (MI > 1) _tile_stored(2, c + 16 * ldc, sc);
  if (MI > 1 && NJ > 1) _tile_stored(3, c + 16 * ldc + 16, sc);
}

thread_local int tile_scope_depth = 0;

TESSERA_AMX void release_tiles() { _tile_release(); }

}  // namespace

AmxTileScope::AmxTileScope() {
  if (tile_scope_depth++ == 0) load_config();
}
AmxTileScope::~AmxTileScope() {
  if (--tile_scope_depth == 0) release_tiles();
}

TESSERA_AMX void amx_gemm_bf16(int64_t M, int64_t N, int64_t K, const uint16_t* a, int64_t lda, const uint16_t* b,
                               int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  TESSERA_CHECK(tile_scope_depth > 0, "amx_gemm_bf16: call inside an AmxTileScope");
  for (int64_t i = 0; i < M; i += 32)
    for (int64_t j = 0; j < N; j += 32) {
      const bool two_i = i + 32 <= M, two_j = j + 32 <= N;
      const uint16_t* ai = a + i * lda;
      const uint16_t* bj = b + 2 * j;
      float* cij = c + i * ldc + j;
      if (two_i && two_j)
        block<2, 2>(K, ai, lda, bj, ldb, cij, ldc, accumulate);
      else if (two_i)
        block<2, 1>(K, ai, lda, bj, ldb, cij, ldc, accumulate);
      else if (two_j)
        block<1, 2>(K, ai, lda, bj, ldb, cij, ldc, accumulate);
      else
        block<1, 1>(K, ai, lda, bj, ldb, cij, ldc, accumulate);
    }
}

TESSERA_AMX void amx_pack_rows(const float* x, int64_t ldx, int64_t rows, int64_t cols, uint16_t* dst,
                               int64_t rows_pad, int64_t cols_pad) {
  for (int64_t r = 0; r < rows_pad; ++r) {
    uint16_t* d = dst + r * cols_pad;
    int64_t c = 0;
    if (r < rows) {
      const float* s = x + r * ldx;
      for (; c + 16 <= cols; c += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + c), bf16_pack(_mm512_loadu_ps(s + c)));
      for (; c < cols; ++c) d[c] = f32_to_bf16(s[c]);
    }
    std::memset(d + c, 0, sizeof(uint16_t) * (cols_pad - c));
  }
}

TESSERA_AMX void amx_pack_rows_transposed(const float* x, int64_t ldx, int64_t rows, int64_t cols, uint16_t* dst,
                                          int64_t cols_pad, int64_t rows_pad) {
  std::memset(dst, 0, sizeof(uint16_t) * cols_pad * rows_pad);
  // 16 x 16 blocks: rows in, transposed in registers, each column out as 16 bf16.
  for (int64_t r0 = 0; r0 < rows; r0 += 16) {
    const int64_t rn = std::min<int64_t>(16, rows - r0);
    for (int64_t c0 = 0; c0 < cols; c0 += 16) {
      const int64_t cn = std::min<int64_t>(16, cols - c0);
      const auto cmask = static_cast<__mmask16>((1u << cn) - 1);
      __m512 v[16];
      for (int64_t r = 0; r < 16; ++r)
        v[r] = r < rn ? _mm512_maskz_loadu_ps(cmask, x + (r0 + r) * ldx + c0) : _mm512_setzero_ps();
      transpose16(v);  // v[c]: column c0 + c of rows r0 .. r0 + 15
      const auto rmask = static_cast<__mmask16>((1u << rn) - 1);
      for (int64_t c = 0; c < cn; ++c)
        _mm256_mask_storeu_epi16(dst + (c0 + c) * rows_pad + r0, rmask, bf16_pack(v[c]));
    }
  }
}

TESSERA_AMX void amx_pack_vnni(const float* x, int64_t ldx, int64_t rows, int64_t cols, uint16_t* dst,
                               int64_t rows_pad, int64_t cols_pad) {
  for (int64_t p = 0; p < rows_pad / 2; ++p) {
    uint16_t* d = dst + p * 2 * cols_pad;
    const int64_t r0 = 2 * p, r1 = 2 * p + 1;
    if (r1 < rows) {  // both rows: 16 columns at a time, the pair's words as (row 2p, row 2p + 1)
      const float *s0 = x + r0 * ldx, *s1 = x + r1 * ldx;
      int64_t c = 0;
      for (; c + 16 <= cols; c += 16)
        _mm512_storeu_si512(d + 2 * c, bf16_pair_words(_mm512_loadu_ps(s0 + c), _mm512_loadu_ps(s1 + c)));
      for (; c < cols; ++c) d[2 * c] = f32_to_bf16(s0[c]), d[2 * c + 1] = f32_to_bf16(s1[c]);
      std::memset(d + 2 * cols, 0, sizeof(uint16_t) * 2 * (cols_pad - cols));
      continue;
    }
    std::memset(d, 0, sizeof(uint16_t) * 2 * cols_pad);
    if (r0 < rows)
      for (int64_t c = 0; c < cols; ++c) d[2 * c] = f32_to_bf16(x[r0 * ldx + c]);
  }
}

TESSERA_AMX void amx_pack_vnni_transposed(const float* x, int64_t ldx, int64_t rows, int64_t cols, uint16_t* dst,
                                          int64_t cols_pad, int64_t rows_pad) {
  // Row j's bf16 values are 32-bit words (pairs of columns); word p of row j goes to column j
  // of pair row p: a transpose of words, 16 x 16 at a time.
  const int64_t words = (cols + 1) / 2, wpad = (words + 15) / 16 * 16;
  alignas(64) uint16_t block[16 * 2 * 256];  // 16 rows of up to 256 words
  TESSERA_CHECK(wpad <= 256, "amx_pack_vnni_transposed: ", cols, " columns, at most 512");
  std::memset(dst, 0, sizeof(uint16_t) * cols_pad * rows_pad);
  uint32_t* d32 = reinterpret_cast<uint32_t*>(dst);
  for (int64_t j0 = 0; j0 < rows; j0 += 16) {
    const int64_t jn = std::min<int64_t>(16, rows - j0);
    for (int64_t r = 0; r < 16; ++r) {
      uint16_t* row = block + r * 2 * wpad;
      std::memset(row, 0, sizeof(uint16_t) * 2 * wpad);
      if (r >= jn) continue;
      const float* src = x + (j0 + r) * ldx;
      int64_t c = 0;
      for (; c + 16 <= cols; c += 16)
        _mm256_store_si256(reinterpret_cast<__m256i*>(row + c), bf16_pack(_mm512_loadu_ps(src + c)));
      for (; c < cols; ++c) row[c] = f32_to_bf16(src[c]);
    }
    for (int64_t p0 = 0; p0 < wpad; p0 += 16) {
      __m512 v[16];
      for (int r = 0; r < 16; ++r) v[r] = _mm512_load_ps(reinterpret_cast<const float*>(block + r * 2 * wpad) + p0);
      transpose16(v);  // v[i]: word p0 + i of the 16 rows
      for (int64_t i = 0; i < 16 && p0 + i < words; ++i) {
        uint32_t* d = d32 + (p0 + i) * rows_pad + j0;
        if (jn == 16)
          _mm512_storeu_ps(reinterpret_cast<float*>(d), v[i]);
        else
          _mm512_mask_storeu_ps(reinterpret_cast<float*>(d), static_cast<__mmask16>((1u << jn) - 1), v[i]);
      }
    }
  }
}

}  // namespace tessera::kernels::cpu
