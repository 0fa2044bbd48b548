// Activation-aware scaling before round-to-nearest quantization: AWQ (Lin et al. 2023,
// "AWQ: Activation-aware Weight Quantization for LLM Compression and Acceleration") and
// SmoothQuant (Xiao et al. 2022, "SmoothQuant: Accurate and Efficient Post-Training
// Quantization for Large Language Models").
//
// Both multiply a linear's input columns by per-channel scales s (W diag(s)) and divide
// its input by them (x / s), which the caller folds into the operation that produces x
// (a norm's weight, the rows of a previous linear): the float product is unchanged, the
// quantized one is not. AWQ searches s to protect the weights that meet large
// activations; SmoothQuant moves activation outliers into the weights so both quantize
// to int8.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "tessera/kernels/quant.h"

namespace tessera::kernels {

struct AwqOptions {
  int64_t group = 128;     // <= 0: one group per output channel
  bool symmetric = false;  // AutoAWQ: zero point (asymmetric)
  int grid = 20;           // candidates of the scale search (ratios 0, 1/grid, ...)
  double max_shrink = 0.5; // clip search: max |w| shrunk by up to this fraction
  bool f16_scales = true;  // scales rounded to f16 (what an AutoAWQ checkpoint stores)
  // Model level (model/calibrated_quant.h): the scales of q/k/v and of gate/up are scored
  // on the whole layer's output over the first calibration windows holding this many
  // tokens (AutoAWQ scores the attention or MLP block), o's and down's on their own
  // output. 0: every linear on its own output (the paper's objective).
  int64_t inspect_tokens = 0;
  // Model level: run the clip search on q and k too. AutoAWQ skips them (attention scores
  // pass through softmax, which the rows' own output error does not see).
  bool clip_qk = false;
};

// The input statistics of one linear (or of several sharing one input) on calibration
// rows x (N, in): mean |x| per channel, max |x| per channel and the Gram matrix X^T X
// (in, in) f32, which turns any weight error D (out, in) into the output error
// ||D X^T||^2 = sum(D * (D G)); with_gram false leaves gram undefined.
struct InputStats {
  std::vector<float> mean_abs, max_abs;
  Tensor gram;
};
InputStats input_stats(const Tensor& x, bool with_gram = true);

// AWQ's scale search (AutoAWQ's _search_best_scale with duo scaling, on the paper's
// objective, the linear's own output): for ratio r = i / grid, i = 0 .. grid - 1,
// s = mean|x|^r / (w_mean^(1 - r) + 1e-4) clamped at 1e-4 and normalised by
// sqrt(max s * min s), where w_mean is the column mean of |w| / max|w| over each row's
// group; the candidate with the least ||(Q(W diag s) diag(1/s) - W) X^T||^2 wins, and
// s = 1 (plain round-to-nearest) is a candidate too, so the result is never worse.
// w (out, in) f32: the rows of every linear that shares x.
std::vector<float> awq_search_scales(const Tensor& w, const InputStats& x, QuantScheme scheme,
                                     const AwqOptions& options);
// The same candidates (s = 1 first, then ratio 0 .. (grid - 1) / grid) scored by another
// objective: `error(q)` for q = dequantize(Q(W diag s)) diag(1 / s), what the quantized
// weight computes in W's frame, (out, in) f32. The first least error wins. (The model
// level scores q on a whole layer's output, AutoAWQ's block objective.)
using AwqError = std::function<double(Tensor fake_quantized)>;
std::vector<float> awq_search_scales(const Tensor& w, const InputStats& x, QuantScheme scheme,
                                     const AwqOptions& options, const AwqError& error);

// AWQ's clip search (AutoAWQ's _compute_best_clip) on rows [row0, row1) of w (out, in)
// f32, in place: per row and group, max |w| shrunk to max * (1 - i / grid) for
// i < max_shrink * grid, the candidate whose quantized group gives the least error
// d^T G_g d of the group's partial product (d: quantized clipped weights minus the
// unclipped ones, G_g the group's block of gram), then the row clamped to +-best.
// gram: X^T X of the input w multiplies (after any scaling).
void awq_clip(Tensor& w, const Tensor& gram, int64_t row0, int64_t row1, QuantScheme scheme,
              const AwqOptions& options);

// SmoothQuant's smoothing factors s_j = max|x_j|^alpha / max_o |w_oj|^(1 - alpha), each
// clamped at 1e-5 (weights and activations as smoothquant/smooth.py). w (out, in) f32:
// the rows of every linear that shares x.
std::vector<float> smoothquant_scales(const Tensor& w, const std::vector<float>& act_absmax,
                                      double alpha);

// w (out, in) f32 with column j multiplied by s[j] (a copy), and gram with entry (j, k)
// divided by s[j] s[k] (the statistics of x / s).
Tensor scale_columns(const Tensor& w, const std::vector<float>& s);
Tensor unscale_gram(const Tensor& gram, const std::vector<float>& s);

}  // namespace tessera::kernels
