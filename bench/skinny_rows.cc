// Weight products of 1-16 rows (decode): the skinny kernel against oneDNN, f32 and
// bf16 weights, 16 weights cycled so most come from memory. Usage: build/bin/skinny_rows
#include <cstdio>
#include <random>
#include "tessera/base/timer.h"
#include "tessera/kernels/matmul.h"
using namespace tessera;
int main() {
  for (DType dt : {DType::kF32, DType::kBF16})
  for (auto [N, K] : std::vector<std::pair<int64_t, int64_t>>{{2304, 768}, {768, 3072}, {5632, 2048}, {2048, 5632}}) {
    const int nw = 16;  // cycled: mostly beyond the cache
    std::vector<Tensor> ws;
    for (int i = 0; i < nw; ++i) { Tensor w = Tensor::empty({N, K}, DType::kF32); float* p = w.data<float>(); for (int64_t j = 0; j < N * K; ++j) p[j] = 0.01f * (j % 7); ws.push_back(w.to(dt)); }
    for (int64_t M : {1, 2, 4, 5, 8, 12, 16}) {
      Tensor a = Tensor::empty({M, K}, DType::kF32), c = Tensor::empty({M, N}, DType::kF32);
      for (int64_t j = 0; j < M * K; ++j) a.data<float>()[j] = 0.5f;
      double ts = 0, to = 0; int reps = 32;
      for (int r = 0; r < reps; ++r) {
        base::Timer t; kernels::matmul_with(kernels::MatmulBackend::kSkinny, a, ws[r % nw], c, false, true, 1.f, 0.f); ts += t.seconds();
        base::Timer t2; kernels::matmul_with(kernels::MatmulBackend::kOneDnn, a, ws[(r + 7) % nw], c, false, true, 1.f, 0.f); to += t2.seconds();
      }
      const double bytes = static_cast<double>(N * K * dtype_size(dt));
      std::printf("%s N=%ld K=%ld M=%ld: skinny %.3f ms (%.1f GB/s), onednn %.3f ms (%.1f GB/s)\n", dtype_name(dt), N, K, M, ts / reps * 1e3, bytes / (ts / reps) / 1e9, to / reps * 1e3, bytes / (to / reps) / 1e9);
    }
  }
}
