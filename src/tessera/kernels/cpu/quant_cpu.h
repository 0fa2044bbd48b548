// CPU kernels behind kernels::quant_matmul (internal to kernels/). Shapes and the
// weight's layout are checked by quant.cc.
#pragma once
#include <optional>

#include "tessera/kernels/quant.h"

namespace tessera::kernels::cpu {

// The GEMV's row kernels, best last (kAvx512Vnni: W8A8 through vpdpbusd).
enum class QuantIsa { kScalar, kAvx2, kAvx512, kAvx512Vnni };
// The best this CPU offers (the dispatch level, TESSERA_ISA-capped, and avx512_vnni).
QuantIsa best_quant_isa();
// Test hook: the quantized GEMV runs `isa` (one this CPU has) until reset with nullopt.
void force_quant_isa_for_testing(std::optional<QuantIsa> isa);

// Dequantize-in-register GEMV: reads each weight once per 4 rows of x.
void quant_gemv(const Tensor& x, const QuantWeight& w, Tensor& y, QuantIsa isa);
// Blocked GEMM: rows of W dequantized a block at a time into a float GEMM (oneDNN); kW8A8
// multiplies int8 rows through the GEMV's integer kernel.
void quant_gemm(const Tensor& x, const QuantWeight& w, Tensor& y, QuantIsa isa);
// Rows [o0, o1) of W dequantized into dst (o1 - o0, in) f32 or bf16, stored column order.
void dequantize_rows(const QuantWeight& w, int64_t o0, int64_t o1, Tensor& dst);

}  // namespace tessera::kernels::cpu
