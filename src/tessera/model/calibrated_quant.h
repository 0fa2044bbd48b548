// Calibrated quantization of a whole model's block linears (GPTQ, AWQ, SmoothQuant), one
// layer at a time as AutoGPTQ and AutoAWQ run it (calibrated_quant.cc).
#pragma once
#include <cstdint>
#include <functional>

#include "tessera/kernels/awq.h"
#include "tessera/kernels/gptq.h"
#include "tessera/model/model.h"

namespace tessera::model {

// The inputs of one layer's block linears on the calibration tokens, (N, in) f32, by
// BlockLinear::which: 0 qkv (norm1's output), 1 o (attention's), 2 up (norm2's), 3 down
// (the activation's).
struct Activations;
struct LayerInputs {
  Tensor x[4];
  // The layer's own input on the calibration tokens (the residual stream and the previous
  // block's output not yet added to it), and the tokens, to run the layer again.
  Tensor layer_x, layer_delta;
  const Activations* acts = nullptr;
};

// Runs the calibration token windows calib_ids (sequences, tokens) i32 through m one
// layer at a time: layer l's inputs are what the float layer l computes from what the
// already-quantized layers 0..l-1 produced; quantize(l, inputs) must quantize layer l
// (Model::quantize_layer), after changing its float weights if it likes (AWQ and
// SmoothQuant fold scales into the norms); then layer l runs again through its quantized
// linears to give layer l + 1 its input. layer_done(l + 1) after each layer. The caller
// finishes with Model::finish_quantization(format).
using LayerQuantizer = std::function<void(int64_t layer, const LayerInputs& inputs)>;
void quantize_layers_calibrated(Model& m, const Tensor& calib_ids, const LayerQuantizer& quantize,
                                const std::function<void(int64_t)>& layer_done = {});

// Per-input-channel scales of layer l's linears (empty: not scaled), by BlockLinear::which.
struct LayerScales {
  std::vector<float> s[4];
};
// Whether linear `which`'s input comes from an operation that a per-channel scale folds
// into exactly: norm1 (qkv) and norm2 (up) always; v's rows (o) only when every query
// head has its own key-value head; up's rows (down) only in a gated MLP (GELU is not
// scale-invariant).
bool input_scale_foldable(const ModelConfig& c, int which);
// Multiplies the input columns of layer l's float linears by s and divides what produces
// their inputs by s (norm weights and biases, v's or up's rows and biases): the float
// model computes the same function (up to rounding in its dtype). A scale for a linear
// that is not foldable is a one-line error.
void scale_layer_inputs(Model& m, int64_t layer, const LayerScales& s);

// GPTQ: each linear's Hessian is X^T X of its inputs (q, k, v share one, as do gate and up).
void quantize_model_gptq(Model& m, const kernels::GptqOptions& options, kernels::QuantScheme scheme,
                         const Tensor& calib_ids, const std::function<void(int64_t)>& layer_done = {});

// AWQ (AutoAWQ's order within a layer): per-input-channel scales searched for each
// linear group on the float weights (q/k/v, gate/up as one group each; with
// options.inspect_tokens, the q/k/v and gate/up candidates scored on the whole layer's
// output over that many calibration tokens, as AutoAWQ scores them on the attention or
// MLP block, the o and down candidates on their own output), folded into the
// operation before it: norm1 for q/k/v, norm2 for gate/up, v's rows for o (only when
// every query head has its own key-value head, as AutoAWQ requires), up's rows for down
// (gated MLPs; GPT-2's GELU is not scale-invariant, so its fc_out is not scaled); then
// each linear's weights clipped per group (not q and k: attention scores are the most
// sensitive), then round-to-nearest in `scheme`.
void quantize_model_awq(Model& m, const kernels::AwqOptions& options, kernels::QuantScheme scheme,
                        const Tensor& calib_ids, const std::function<void(int64_t)>& layer_done = {});

// SmoothQuant W8A8: smoothing factors with migration strength alpha for q/k/v (folded
// into norm1), gate/up (norm2) and down (up's rows; gated MLPs), as llm-compressor's
// Llama mappings; then every linear int8 per output channel, activations int8 per token
// at run time.
void quantize_model_smoothquant(Model& m, double alpha, const Tensor& calib_ids,
                                const std::function<void(int64_t)>& layer_done = {});

}  // namespace tessera::model
