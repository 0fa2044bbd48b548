// Scalar reference embedding: row copies and a token-order scatter-add.
#include "tessera/kernels/reference/embedding_ref.h"

#include "tessera/kernels/reference/reference_util.h"

namespace tessera::kernels::reference {

void embedding_forward(const Tensor& weight, const Tensor& ids, Tensor& out, bool accumulate) {
  const Tensor w = weight.to(DType::kF32);  // bf16 -> f32 is exact
  for (int64_t n = 0; n < out.size(0); ++n) {
    const float* src = ref_row<float>(w, ids.data<int32_t>()[n]);
    float* dst = ref_row<float>(out, n);
    for (int64_t i = 0; i < out.size(1); ++i) dst[i] = accumulate ? dst[i] + src[i] : src[i];
  }
}

void embedding_backward(const Tensor& dout, const Tensor& ids, Tensor& dweight) {
  for (int64_t n = 0; n < dout.size(0); ++n) {
    float* dst = ref_row<float>(dweight, ids.data<int32_t>()[n]);
    const float* src = ref_row<float>(dout, n);
    for (int64_t i = 0; i < dout.size(1); ++i) dst[i] += src[i];
  }
}

}  // namespace tessera::kernels::reference
