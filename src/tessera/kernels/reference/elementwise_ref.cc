// Scalar reference elementwise helpers, one element at a time.
#include "tessera/kernels/reference/elementwise_ref.h"

#include <vector>

#include "tessera/kernels/reference/reference_util.h"

namespace tessera::kernels::reference {

void add_inplace(Tensor& a, const Tensor& b) {
  for (int64_t n = 0; n < a.size(0); ++n)
    for (int64_t i = 0; i < a.size(1); ++i) ref_row<float>(a, n)[i] += ref_row<float>(b, n)[i];
}

void add_bias(Tensor& x, const Tensor& bias) {
  for (int64_t n = 0; n < x.size(0); ++n)
    for (int64_t i = 0; i < x.size(1); ++i)
      ref_row<float>(x, n)[i] += static_cast<float>(ref_param(bias, i));
}

void bias_backward(const Tensor& dout, Tensor& dbias) {
  std::vector<double> s(dout.size(1), 0.0);
  for (int64_t n = 0; n < dout.size(0); ++n)
    for (int64_t i = 0; i < dout.size(1); ++i) s[i] += ref_row<float>(dout, n)[i];
  for (int64_t i = 0; i < dout.size(1); ++i) dbias.data<float>()[i] += static_cast<float>(s[i]);
}

void scale_inplace(Tensor& a, float s) {
  float* p = a.data<float>();
  for (int64_t i = 0; i < a.numel(); ++i) p[i] *= s;
}

}  // namespace tessera::kernels::reference
