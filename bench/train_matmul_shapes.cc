// Times every matmul shape of one GPT-2 124M training step (batch 4 x 64) through
// kernels::matmul, to show where the step's time goes. Usage: train_matmul_shapes
#include <algorithm>
#include <cstdio>
#include <vector>

#include "tessera/base/timer.h"
#include "tessera/kernels/matmul.h"

using namespace tessera;

namespace {

double time_shape(const char* what, int64_t m, int64_t n, int64_t k, bool ta, bool tb, float beta) {
  Tensor a = Tensor::empty(ta ? Shape{k, m} : Shape{m, k}, DType::kF32);
  Tensor b = Tensor::empty(tb ? Shape{n, k} : Shape{k, n}, DType::kF32);
  Tensor c = Tensor::zeros({m, n}, DType::kF32);
  a.fill(0.01f);
  b.fill(0.02f);
  kernels::matmul(a, b, c, ta, tb, 1.f, beta);  // warm-up: primitive creation
  std::vector<double> s;
  for (int i = 0; i < 5; ++i) {
    base::Timer t;
    kernels::matmul(a, b, c, ta, tb, 1.f, beta);
    s.push_back(t.seconds());
  }
  std::sort(s.begin(), s.end());
  std::printf("%-24s m=%5lld n=%5lld k=%5lld ta=%d tb=%d  %7.2f ms  %5.0f GFLOP/s\n", what,
              (long long)m, (long long)n, (long long)k, ta, tb, s[2] * 1e3,
              2.0 * m * n * k / s[2] / 1e9);
  return s[2];
}

}  // namespace

int main() {
  const int64_t N = 256, H = 768, F = 3072, V = 50257, L = 12;
  double total = 0;
  total += L * time_shape("fwd c_attn", N, 3 * H, H, false, false, 0);
  total += L * time_shape("fwd attn.c_proj", N, H, H, false, false, 0);
  total += L * time_shape("fwd c_fc", N, F, H, false, false, 0);
  total += L * time_shape("fwd mlp.c_proj", N, H, F, false, false, 0);
  total += time_shape("fwd lm_head", N, V, H, false, true, 0);
  total += L * time_shape("dx c_attn", N, H, 3 * H, false, true, 0);
  total += L * time_shape("dx attn.c_proj", N, H, H, false, true, 0);
  total += L * time_shape("dx c_fc", N, H, F, false, true, 0);
  total += L * time_shape("dx mlp.c_proj", N, F, H, false, true, 0);
  total += time_shape("dx lm_head", N, H, V, false, false, 0);
  total += L * time_shape("dW c_attn", H, 3 * H, N, true, false, 1);
  total += L * time_shape("dW attn.c_proj", H, H, N, true, false, 1);
  total += L * time_shape("dW c_fc", H, F, N, true, false, 1);
  total += L * time_shape("dW mlp.c_proj", F, H, N, true, false, 1);
  total += time_shape("dW lm_head", V, H, N, true, false, 1);
  std::printf("matmul time of one step: %.3f s\n", total);
  return 0;
}
