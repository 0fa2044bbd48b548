// What the quantized GEMV's per-ISA row kernels share (internal to kernels/cpu): the
// prepared activations, the stored codes, and the AVX-512 kernels' entry points.
#pragma once
#include <cstdint>
#include <vector>

#include "tessera/kernels/cpu/quant_cpu.h"
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
  // The integer-dot GEMV's x (gemv_quantizes_activations), from prepare_int_dot: each run
  // of 32 stored columns quantized to s8 with its own scale. int4 lays each 128 columns
  // out as the four runs' first halves, then their second halves (what the low and high
  // nibbles of 64 packed bytes multiply); int8 and int4's last partial 128 keep column
  // order. lane_scale holds, per chunk of a product (128 int4 / 64 int8 columns), the run
  // scale of each of the 16 int32 lanes.
  std::vector<int8_t> xd;           // (rows, in)
  std::vector<float> run_scale;     // (rows, in / 32)
  std::vector<float> lane_scale;    // (rows, chunks, 16)
  // int8 only: (rows, groups), each group's sum of x as quantized (run scale x code). The
  // AVX2 kernel multiplies code - 128 and adds 128 x this back.
  std::vector<float> qsum;
};

// The weight group of a column that walks a row left to right, kept as a running quotient
// (column = g * group + rem): the int-dot kernels asked for it per row and chunk, and the
// 64-bit division was a quarter of the int4 GEMV's time.
struct GroupCursor {
  int64_t group, g = 0, rem = 0;
  explicit GroupCursor(int64_t group_size) : group(group_size) {}
  // The group of the current column, then the column moves on by `cols`.
  int64_t advance(int64_t cols) {
    const int64_t here = g;
    for (rem += cols; rem >= group; rem -= group) ++g;
    return here;
  }
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

// Whether the GEMV at this ISA level multiplies int8 / int4 codes by x quantized to s8 per
// run of 32 columns (llama.cpp's Q8_0 x Q4_0 route: 64 products per instruction, so
// decode is bound by the bytes of the weights, not by widening them to f32): int4 from
// AVX2 (vpmaddubsw; its int16 pair sums cannot saturate at 15 x 127 x 2), int8 with
// VNNI (vpdpbusd) or AVX2 (code - 128 as |.| times x with its sign, vpmaddubsw: 128 x 127
// x 2 cannot saturate; 255 x 127 x 2 would). AVX-512 without VNNI keeps int8's float
// kernel (AVX-512 has no vpsignb). The result is reference::quant_matmul_a8_runs's.
bool gemv_quantizes_activations(const QuantWeight& w, QuantIsa isa);
// Fills a.xd, run_scale and lane_scale from a.x (AVX-512 or the reference rounding: the
// same bits).
void prepare_int_dot(const QuantWeight& w, Activations& a);
void rows_int_dot_avx512(const QuantWeight& w, const Activations& a, int64_t m0, int mb, float* y,
                         int64_t ldy, int64_t o0, int64_t o1, bool vnni);
// reference::quantize_row_s8 sixteen (AVX-512) or eight (AVX2) values at a time, to the
// same bits; _fast is the best this CPU has.
float quantize_row_s8_avx512(const float* x, int64_t n, int8_t* q);
float quantize_row_s8_avx2(const float* x, int64_t n, int8_t* q);
float quantize_row_s8_fast(const float* x, int64_t n, int8_t* q);

}  // namespace tessera::kernels::cpu
