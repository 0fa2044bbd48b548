// GPTQ (Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative
// Pre-trained Transformers"): a linear layer's weights quantized one input column at a
// time, each column's rounding error spread over the columns not yet quantized through the
// inverse Hessian of the layer's reconstruction error, H = sum over calibration rows of
// x x^T. As AutoGPTQ's fasterquant: dead inputs (H_jj = 0) zeroed, damping
// percdamp x mean(diag H), the inverse Hessian's upper Cholesky factor, lazy batches of
// `block` columns, group parameters found on the current (updated) weights when a group
// starts, and act-order (columns by decreasing H_jj) stored as QuantWeight::perm.
#pragma once
#include <cstdint>
#include <vector>

#include "tessera/kernels/quant.h"

namespace tessera::kernels {

struct GptqOptions {
  int64_t group = 128;       // <= 0: one group per output channel
  bool symmetric = false;
  bool act_order = false;
  double percdamp = 0.01;
  int64_t block = 128;       // lazy-batch width
  bool f16_scales = false;   // scales rounded to f16 as they are found (checkpoint form)
};

// w (out, in) f32 or bf16; hessian (in x in, row-major, f64 for the sums of many outer
// products), symmetric positive semi-definite (any positive multiple of X^T X). kInt8 or
// kInt4; a one-line error for anything else.
QuantWeight quantize_gptq(const Tensor& w, const std::vector<double>& hessian, QuantScheme scheme,
                          const GptqOptions& options = {});

}  // namespace tessera::kernels
