// Scalar reference cross-entropy: log-sum-exp and softmax in double, row by row.
#include "tessera/kernels/reference/cross_entropy_ref.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "tessera/kernels/reference/reference_util.h"

namespace tessera::kernels::reference {

CrossEntropyResult cross_entropy(const Tensor& logits, const Tensor& targets, Tensor* losses,
                                 Tensor* dlogits, float grad_scale) {
  const int64_t N = logits.size(0), V = logits.size(1);
  CrossEntropyResult r;
  std::vector<double> row(V);
  for (int64_t n = 0; n < N; ++n) {
    const int32_t t = targets.data<int32_t>()[n];
    const float* x = ref_row<float>(logits, n);
    std::copy(x, x + V, row.begin());  // dlogits may alias logits
    float* d = dlogits ? ref_row<float>(*dlogits, n) : nullptr;
    if (t == kIgnoreIndex) {
      if (losses) losses->data<float>()[n] = 0.f;
      if (d) std::fill(d, d + V, 0.f);
      continue;
    }
    const double mx = *std::max_element(row.begin(), row.end());
    double sum = 0;
    for (double v : row) sum += std::exp(v - mx);
    const double loss = std::log(sum) + mx - row[t];
    if (losses) losses->data<float>()[n] = static_cast<float>(loss);
    r.loss_sum += loss;
    ++r.count;
    if (d)
      for (int64_t i = 0; i < V; ++i)
        d[i] = static_cast<float>(grad_scale * (std::exp(row[i] - mx) / sum - (i == t ? 1 : 0)));
  }
  return r;
}

}  // namespace tessera::kernels::reference
