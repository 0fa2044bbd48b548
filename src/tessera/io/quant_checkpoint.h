// Quantized linear layers in the Hugging Face ecosystem's checkpoint layouts: AutoGPTQ
// ("gptq", int32-packed qweight / qzeros, f16 scales, g_idx) and AutoAWQ ("awq", GEMM
// version: qweight / qzeros packed along the output dim in AWQ's interleaved order, f16
// scales) and llm-compressor's compressed-tensors W8A8 (weight I8, weight_scale (out, 1))
// and fp8 (weight F8_E4M3, weight_scale (out, groups)),
// and the `quantization_config` block of config.json that says which.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "tessera/io/quant_config.h"
#include "tessera/kernels/quant.h"
#include "tessera/tensor/tensor.h"

namespace tessera::io {



// The checkpoint tensors of one linear module (suffix -> tensor, e.g. "qweight"), for
// a weight w of scheme kInt8 / kInt4 (bits as f.bits) quantized with f.group_size (in,
// when -1): gptq writes qweight (in * bits / 32, out) i32, qzeros (groups, out * bits / 32)
// i32, scales (groups, out) f16, g_idx (in) i32; awq writes qweight (in, out * bits / 32),
// qzeros (groups, out * bits / 32), scales (groups, out) f16; compressed-tensors writes
// weight (out, in) i8 (kW8A8) or f8e4m3 (kFp8) and weight_scale (out, groups) f32. gptq / awq scales are rounded to f16
// (quantizers here round them before choosing the integers, so nothing changes).
std::vector<std::pair<std::string, Tensor>> pack_quant_linear(const kernels::QuantWeight& w,
                                                              const QuantCheckpointFormat& f);

// The weight (out, in) of module `module` back from its tensors (get(suffix) returns the
// tensor or throws a one-line error naming it). Shapes and dtypes are checked against
// out / in / f; a desc_act g_idx becomes the weight's perm (columns sorted by group, each
// group of exactly group_size columns, else a one-line error).
kernels::QuantWeight unpack_quant_linear(const std::function<Tensor(const std::string&)>& get,
                                         int64_t out, int64_t in, const QuantCheckpointFormat& f,
                                         const std::string& module);

// The tensor suffixes a module of this format has (for listing what a loader reads).
std::vector<std::string> quant_linear_suffixes(const QuantCheckpointFormat& f);

}  // namespace tessera::io
