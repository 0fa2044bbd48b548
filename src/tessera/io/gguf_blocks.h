// llama.cpp's tensor block formats (ggml-common.h / ggml-quants.c, the published layouts):
// dequantizing F32, F16, BF16, Q8_0, Q4_0, Q4_K and Q6_K rows; quantizing to F32, F16, BF16,
// Q8_0, Q4_0 and Q4_K as ggml's reference quantizers (quantize_row_*_ref) do; and the exact
// form of Q8_0, Q4_0, Q4_K and Q6_K weights in Tessera's quantized kernels.
//
//   Q8_0  blocks of 32: f16 d, 32 x int8 q                      x = d q
//   Q4_0  blocks of 32: f16 d, 16 bytes, byte j = q[j] | q[j+16] << 4    x = d (q - 8)
//   Q4_K  super-blocks of 256: f16 d, f16 dmin, 12 bytes of 6-bit scales sc and mins m for
//         8 sub-blocks of 32, 128 bytes of nibbles (per 64 values: 32 bytes, low nibbles the
//         first 32, high nibbles the next 32)                  x = d sc q - dmin m
//   Q6_K  super-blocks of 256: 128 bytes low 4 bits, 64 bytes high 2 bits, 16 int8 scales
//         (one per 16 values), f16 d                            x = d sc (q - 32)
#pragma once
#include <cstdint>
#include <optional>
#include <string>

#include "tessera/io/gguf.h"
#include "tessera/kernels/quant.h"

namespace tessera::io {

bool ggml_can_dequantize(GgmlType t);  // F32 F16 BF16 Q8_0 Q4_0 Q4_K Q6_K
bool ggml_can_quantize(GgmlType t);    // F32 F16 BF16 Q8_0 Q4_0 Q4_K

// One row of n values (a whole number of blocks).
void dequantize_row(GgmlType t, const uint8_t* src, int64_t n, float* dst);
void quantize_row(GgmlType t, const float* src, int64_t n, uint8_t* dst);
// A (rows, cols) tensor, rows in parallel. `what` names it in errors (unsupported type,
// cols not a whole number of blocks).
void dequantize_rows(GgmlType t, const uint8_t* src, int64_t rows, int64_t cols, float* dst,
                     const std::string& what);
std::string quantize_rows(GgmlType t, const float* src, int64_t rows, int64_t cols,
                          const std::string& what);

// The kernels' exact form of a (rows, cols) GGUF tensor:
//   Q8_0 -> int8 group 32: code q + 128, zero 128, scale d
//   Q4_0 -> int4 group 32: the same nibbles, zero 8, scale d
//   Q4_K -> int4 group 32: scale d sc, zero dmin m / (d sc) (a real number: the kernels
//           compute s (q - z) in float); a sub-block with d sc = 0 holds the constant
//           -dmin m, stored as codes 0, zero 1, scale dmin m
//   Q6_K -> int8 group 16: code q, zero 32, scale d sc
// std::nullopt for other types. Not validated (a file's f16 inf or nan gets through):
// QuantWeight::validate names what is wrong.
std::optional<kernels::QuantWeight> gguf_quant_weight(GgmlType t, const uint8_t* src, int64_t rows,
                                                      int64_t cols);

}  // namespace tessera::io
