// What the quantized GEMV's per-ISA row kernels share (internal to kernels/cpu): the
// prepared activations, the stored codes, and the AVX-512 kernels' entry points.
#pragma once
#include <cstdint>
#include <vector>

#include "tessera/kernels/quant.h"

namespace tessera::kernels::cpu {

// x as the weight's stored columns see it: permuted and smoothed into scratch when the
// weight asks for it, else x itself. Rows of `ld` floats.
struct Activations {
  const float* x = nullptr;
  int64_t ld = 0;
  int64_t rows = 0;
  bool permuted = false;  // x is scratch (thread_local: reused call after call)
  std::vector<float> scratch;
  std::vector<float> xsum;   // (rows, groups): sum of each group's x, for zero points
  std::vector<int8_t> xq;    // W8A8: (rows, in) s8
  std::vector<float> xscale; // W8A8: (rows)
};

// The code of stored weight j of a row (int4 unpacked) and its value before the scale.
inline int code_at(QuantScheme s, const uint8_t* row, int64_t j) {
  if (s == QuantScheme::kInt4) {
    const uint8_t b = row[(j / 32) * 16 + (j % 32) % 16];
    return (j % 32) < 16 ? (b & 0xF) : (b >> 4);
  }
  return row[j];
}
inline float unscaled(QuantScheme s, const uint8_t* row, int64_t j) {
  const int c = code_at(s, row, j);
  return s == QuantScheme::kFp8 ? fp8_e4m3_to_f32(static_cast<uint8_t>(c)) : static_cast<float>(c);
}

inline int64_t row_bytes(const QuantWeight& w) { return w.scheme == QuantScheme::kInt4 ? w.in / 2 : w.in; }

// y[m0 + m][o] for m < mb (at most 4) and o in [o0, o1), AVX-512 (F, BW, VL, DQ): the float
// schemes widen 16 codes per register; W8A8 multiplies s8 by s8 with VNNI's vpdpbusd
// where the CPU has it (avx512_vnni), else with vpmaddubsw.
void rows_avx512(const QuantWeight& w, const Activations& a, int64_t m0, int mb, float* y,
                 int64_t ldy, int64_t o0, int64_t o1);
void rows_s8_avx512(const QuantWeight& w, const Activations& a, int64_t m0, int mb, float* y,
                    int64_t ldy, int64_t o0, int64_t o1, bool vnni);

}  // namespace tessera::kernels::cpu
