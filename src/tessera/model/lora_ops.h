// The LoRA adapters' share of the block linears (Model::set_lora), forward and backward.
// Internal to model/.
#pragma once
#include <cstdint>
#include <vector>

#include "tessera/model/model.h"
#include "tessera/tensor/tensor.h"

namespace tessera::model {

// y (N, out) of layer l's block linear `which` (0 qkv, 1 o, 2 up, 3 down) from its input
// x (N, in): y[:, rows of module m] += s B_m A_m dropout(x)^T for each adapted module. The
// dropout (training passes only) draws its mask from the model's LoRA seed, the layer, the
// module and the element, so the backward (and a recompute) sees the same mask.
// With `groups` (multi-LoRA serving, Model::set_lora_bank): each group's rows get their own
// adapter of the bank instead (rows of no group: the base model only).
struct LoraGroups;
void lora_forward(const Model& m, int64_t l, int which, const Tensor& x, Tensor& y, bool training,
                  const LoraGroups* groups = nullptr);

// The rows of one serving batch that share an adapter of the bank (Punica's segments): the
// base GEMM runs once over every row, then each group adds its low-rank product over its
// rows alone. Rows that are contiguous [begin, begin + rows.size()) are used in place;
// others are gathered and the product scattered back.
struct LoraGroups {
  struct Group {
    int32_t adapter = 0;        // index into Model::lora_bank()
    std::vector<int64_t> rows;  // ascending
    int64_t begin = -1;         // rows[0] when the rows are contiguous, else -1
  };
  std::vector<Group> groups;  // by adapter index; adapters with no rows have no group
};
// Groups of row_adapter (N): row i uses adapter row_adapter[i] (-1: none). Throws for an
// index outside [-1, bank_size).
LoraGroups group_rows_by_adapter(const std::vector<int32_t>& row_adapter, int64_t bank_size);

// From dy, the gradient of that linear's output: adds the adapters' gradients (A and B, into
// Model::lora_grads()) and their share of the input gradient to dx (N, in).
void lora_backward(const Model& m, int64_t l, int which, const Tensor& x, const Tensor& dy, Tensor& dx);

}  // namespace tessera::model
