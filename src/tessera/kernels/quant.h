// Quantized linear weights and their products: y = x @ W^T with W stored in 8, 4 or
// fp8 bits and dequantized in registers (decode GEMV) or per block into a float GEMM
// (prefill). The packed layouts here are chosen for the kernels; io/ converts them to
// and from the ecosystem's on-disk forms (AutoGPTQ / AutoAWQ tensors, GGUF blocks).
//
//   kInt8  (W8A16): W[o][k] = s[o][g] * (q[o][k] - z[o][g]), q u8, g = k / group
//   kInt4  (W4A16): the same with q in 0..15, two per byte
//   kFp8   (W8A16, fp8): W[o][k] = s[o][g] * e4m3(q[o][k])  (no zero point)
//   kW8A8  (SmoothQuant): W[o][k] = s[o] * q[o][k], q s8 symmetric per output channel;
//          each row of x is quantized to s8 with its own absmax scale at run time and the
//          product is an exact int32 dot product, scaled.
// group: the run of input columns sharing a scale (32, 64, 128, ... or `in`: one scale per
// output channel). Optional extras: perm (GPTQ act-order) stores column perm[j] of W at
// position j, so a group is a run of stored columns and the kernel reads x[perm[j]];
// smooth (SmoothQuant, when not folded into the previous norm) divides x[k] by smooth[k].
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "tessera/tensor/tensor.h"

namespace tessera::kernels {

enum class QuantScheme : uint8_t { kInt8, kInt4, kFp8, kW8A8 };
const char* quant_scheme_name(QuantScheme s);  // "int8" | "int4" | "fp8" | "w8a8"
QuantScheme parse_quant_scheme(const std::string& name);  // one-line error otherwise
int quant_bits(QuantScheme s);                             // 8, 4, 8, 8

struct QuantWeight {
  QuantScheme scheme = QuantScheme::kInt8;
  int64_t out = 0, in = 0;
  int64_t group = 0;  // divides in; a multiple of 32 for kInt4
  // kInt8 / kFp8: (out, in) u8; kW8A8: (out, in) i8; kInt4: (out, in / 2) u8 where each
  // run of 32 weights w[0..32) is 16 bytes, byte j holding w[j] (low nibble) and w[j + 16]
  // (high nibble), as llama.cpp's Q4_0 blocks.
  Tensor q;
  Tensor scales;  // (out, in / group) f32
  Tensor zeros;   // (out, in / group) f32, kInt8 / kInt4 only: integers except from GGUF's K-quants
  Tensor perm;    // (in) i32, or undefined: stored column j is W's column perm[j]
  Tensor smooth;  // (in) f32, or undefined: x[k] / smooth[k] is what W multiplies

  int64_t groups() const { return group > 0 ? in / group : 0; }
  // Bytes the product reads per call (q, scales, zeros): what decode streams per token.
  int64_t nbytes() const;
  // Shapes, dtypes and values in range (group divides in, perm a permutation, ...): a
  // one-line error naming `what` (e.g. the checkpoint tensor) otherwise.
  void validate(const std::string& what) const;
};

// Round-to-nearest quantization of w (out, in) f32 or bf16, per group with GPTQ's
// quantizer (the range always includes 0). kInt8 / kInt4: asymmetric, scale
// (max - min) / (2^bits - 1) and integer zero point round(-min / scale), or symmetric,
// scale 2 absmax / (2^bits - 1) and zero 2^(bits-1) (a group with no negative value gets
// zero 1 and scale max / (2^bits - 2): AutoGPTQ's format stores z - 1); kFp8: scale absmax / 448 per group;
// kW8A8: per output channel, absmax / 127 (group is ignored: in).
// f16_scales: each scale is rounded to the nearest f16 before the integers are chosen
// (what an AutoGPTQ / AutoAWQ checkpoint stores, so saving one changes nothing).
QuantWeight quantize_rtn(const Tensor& w, QuantScheme scheme, int64_t group,
                         bool symmetric = false, bool f16_scales = false);
// The integers RTN (or GPTQ, column by column) stores for column values `w` under one
// group's scale and zero: clamp(round(w / s) + z, 0, 2^bits - 1).
int32_t quantize_value(float w, float scale, float zero, int bits);

// Output rows [o0, o1) of w (copies), and the rows of several weights stacked (one fused
// linear from its parts: q, k, v or gate, up). Stacked parts must agree on everything
// but `out` (scheme, in, group, perm, smooth), except that int8 / int4 parts of different
// schemes or groups (one dividing the others) are stacked as int8 at the smallest group,
// the same values; a one-line error naming `what` otherwise.
QuantWeight quant_rows(const QuantWeight& w, int64_t o0, int64_t o1);
QuantWeight quant_stack_rows(const std::vector<QuantWeight>& parts, const std::string& what);

// W (out, in) f32 in its original column order (perm undone; smooth not applied).
Tensor dequantize(const QuantWeight& w);

// y (M, out) f32 = x (M, in) f32 @ W^T (overwritten). x rows may be strided; y contiguous
// rows. Small M runs the dequantize-in-register GEMV of this CPU's ISA level (AVX-512 /
// AVX2 / scalar), larger M dequantizes blocks of W into a float GEMM (oneDNN); kW8A8
// multiplies in int8.
void quant_matmul(const Tensor& x, const QuantWeight& w, Tensor& y);

// Forced implementations, for tests and benchmarks: kGemv at any M, kGemm at any M,
// kReference the scalar one (kernels/reference).
enum class QuantPath { kAuto, kGemv, kGemm, kReference };
void quant_matmul_with(QuantPath path, const Tensor& x, const QuantWeight& w, Tensor& y);

// fp8 e4m3 codes convert with tessera::fp8_e4m3_to_f32 / f32_to_fp8_e4m3 (tensor/dtype.h).
using tessera::f32_to_fp8_e4m3;
using tessera::fp8_e4m3_to_f32;

}  // namespace tessera::kernels
