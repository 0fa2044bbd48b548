// Plain accessors shared by the scalar reference kernels (tests only): row pointers of
// strided (N, F) tensors and element reads of f32 / bf16 parameter vectors.
#pragma once
#include "tessera/tensor/tensor.h"

namespace tessera::kernels::reference {

template <typename T>
T* ref_row(const Tensor& t, int64_t n) {
  return static_cast<T*>(t.raw_data()) + n * t.stride(0);
}

// Element i of a contiguous 1-D f32 / bf16 tensor, widened to double.
inline double ref_param(const Tensor& p, int64_t i) { return p.item_f32(i); }

}  // namespace tessera::kernels::reference
