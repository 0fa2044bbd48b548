// Scalar references for the quantized products (kernels/quant.h), used by tests.
#pragma once
#include "tessera/kernels/quant.h"

namespace tessera::kernels::reference {

// W (out, in) f32 in its original column order.
Tensor dequantize(const QuantWeight& w);
// y = x @ W^T: x smoothed and permuted as the weight says, then a double-accumulated dot
// with the dequantized weight; kW8A8 quantizes each row of x to s8 (absmax / 127, round to
// nearest even) and sums exact integer products.
void quant_matmul(const Tensor& x, const QuantWeight& w, Tensor& y);
// One row of x as W8A8 multiplies it: q[k] in -127..127 and the row's scale.
float quantize_row_s8(const float* x, int64_t n, int8_t* q);
// The int8 / int4 decode GEMV's integer-dot form (cpu::gemv_quantizes_activations): each
// run of 32 stored columns of x quantized to s8 with its own scale (quantize_row_s8 on the
// run), the codes' integer dot products per run exact, then
// y = sum over runs of s_x(run) s_w(group) dot - sum over groups of s_w z sum(x_group),
// the last with x in float.
void quant_matmul_a8_runs(const Tensor& x, const QuantWeight& w, Tensor& y);

}  // namespace tessera::kernels::reference
