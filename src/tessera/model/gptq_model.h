// GPTQ over a whole model's block linears, calibrated layer by layer (gptq_model.cc).
#pragma once
#include <cstdint>
#include <functional>

#include "tessera/kernels/gptq.h"
#include "tessera/model/model.h"

namespace tessera::model {

// Quantizes every block linear of m (whole model, float) with GPTQ on the calibration
// token windows calib_ids (sequences, tokens) i32; layer_done(l) after each layer. The
// caller finishes with Model::finish_quantization(format).
void quantize_model_gptq(Model& m, const kernels::GptqOptions& options, kernels::QuantScheme scheme,
                         const Tensor& calib_ids, const std::function<void(int64_t)>& layer_done = {});

}  // namespace tessera::model
