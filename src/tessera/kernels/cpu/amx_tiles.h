// Small bf16 products on AMX tiles (the attention kernels' bf16 path), and the packings
// they read. Call only where cpu_has(IsaLevel::kAmx) (the OS has granted the tile state:
// base::cpu_features requests it).
//
// Layouts. An A operand is bf16 rows (M x K, row stride lda elements). A B operand (K x N)
// is in VNNI pairs: row p of the packing holds, for each column j, B[2p][j] then B[2p+1][j]
// (row stride ldb elements, >= 2N). M and N are multiples of 16, K of 32; callers pad with
// zeros.
#pragma once
#include <cstdint>

namespace tessera::kernels::cpu {

// While one is alive on a thread, that thread's tiles hold amx_gemm_bf16's configuration
// (loaded once: it costs as much as a small product). Nothing else may use the tiles on the
// thread meanwhile (no oneDNN call inside one).
class AmxTileScope {
 public:
  AmxTileScope();
  ~AmxTileScope();
  AmxTileScope(const AmxTileScope&) = delete;
  AmxTileScope& operator=(const AmxTileScope&) = delete;
};

// c (M x N) f32, row stride ldc floats: c = (accumulate ? c : 0) + A B. Inside an AmxTileScope.
void amx_gemm_bf16(int64_t M, int64_t N, int64_t K, const uint16_t* a, int64_t lda, const uint16_t* b,
                   int64_t ldb, float* c, int64_t ldc, bool accumulate);

// A operand from f32 rows: dst (rows_pad x cols_pad) = bf16(x) for r < rows, c < cols, else 0.
void amx_pack_rows(const float* x, int64_t ldx, int64_t rows, int64_t cols, uint16_t* dst, int64_t rows_pad,
                   int64_t cols_pad);
// A operand of x^T: dst (cols_pad x rows_pad) with dst[c][r] = bf16(x[r][c]) inside, else 0.
void amx_pack_rows_transposed(const float* x, int64_t ldx, int64_t rows, int64_t cols, uint16_t* dst,
                              int64_t cols_pad, int64_t rows_pad);
// B operand of x itself (K = x's rows): dst (rows_pad / 2 x 2 cols_pad) with
// dst[p][2j + e] = bf16(x[2p + e][j]); rows past `rows` and columns past `cols` are 0.
void amx_pack_vnni(const float* x, int64_t ldx, int64_t rows, int64_t cols, uint16_t* dst, int64_t rows_pad,
                   int64_t cols_pad);
// B operand of x^T (K = x's columns, at most 512): dst (cols_pad / 2 x 2 rows_pad) with
// dst[p][2j + e] = bf16(x[j][2p + e]); outside x, 0.
void amx_pack_vnni_transposed(const float* x, int64_t ldx, int64_t rows, int64_t cols, uint16_t* dst,
                              int64_t cols_pad, int64_t rows_pad);

}  // namespace tessera::kernels::cpu
