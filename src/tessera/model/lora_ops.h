// The LoRA adapters' share of the block linears (Model::set_lora), forward and backward.
// Internal to model/.
#pragma once
#include <cstdint>

#include "tessera/model/model.h"
#include "tessera/tensor/tensor.h"

namespace tessera::model {

// y (N, out) of layer l's block linear `which` (0 qkv, 1 o, 2 up, 3 down) from its input
// x (N, in): y[:, rows of module m] += s B_m A_m dropout(x)^T for each adapted module. The
// dropout (training passes only) draws its mask from the model's LoRA seed, the layer, the
// module and the element, so the backward (and a recompute) sees the same mask.
void lora_forward(const Model& m, int64_t l, int which, const Tensor& x, Tensor& y, bool training);

// From dy, the gradient of that linear's output: adds the adapters' gradients (A and B, into
// Model::lora_grads()) and their share of the input gradient to dx (N, in).
void lora_backward(const Model& m, int64_t l, int which, const Tensor& x, const Tensor& dy, Tensor& dx);

}  // namespace tessera::model
