// Times every matmul shape of one GPT-2 124M training step (batch 4 x 64) through
// kernels::matmul, to show where the step's time goes: f32 operands, or bf16 operands as
// native bf16 training multiplies them (AMX where the CPU has it).
// With "cold", every timed call finds its operands out of cache (a 512 MB sweep before
// each), as a training step does: its weights, activations and gradients were last touched
// a whole layer stack earlier.
// Usage: train_matmul_shapes [f32|bf16] [VOCAB=50257] [cold]
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "tessera/base/timer.h"
#include "tessera/kernels/matmul.h"

using namespace tessera;

namespace {

DType g_dtype = DType::kF32;
bool g_cold = false;

void evict_caches() {
  static std::vector<char> sweep(size_t{512} << 20);
  for (size_t i = 0; i < sweep.size(); i += 64) sweep[i] = static_cast<char>(sweep[i] + 1);
}

double time_shape(const char* what, int64_t m, int64_t n, int64_t k, bool ta, bool tb, float beta) {
  Tensor a = Tensor::empty(ta ? Shape{k, m} : Shape{m, k}, DType::kF32);
  Tensor b = Tensor::empty(tb ? Shape{n, k} : Shape{k, n}, DType::kF32);
  Tensor c = Tensor::zeros({m, n}, DType::kF32);
  a.fill(0.01f);
  b.fill(0.02f);
  a = a.to(g_dtype);
  b = b.to(g_dtype);
  kernels::matmul(a, b, c, ta, tb, 1.f, beta);  // warm-up: primitive creation
  std::vector<double> s;
  for (int i = 0; i < 5; ++i) {
    if (g_cold) evict_caches();
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

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "bf16") == 0) g_dtype = DType::kBF16;
  else if (argc > 1 && std::strcmp(argv[1], "f32") != 0) {
    std::fprintf(stderr, "train_matmul_shapes: operand dtype must be f32 or bf16, got '%s'\n", argv[1]);
    return 2;
  }
  const int64_t N = 256, H = 768, F = 3072, L = 12;
  const int64_t V = argc > 2 ? std::atoll(argv[2]) : 50257;  // vocabulary (lm_head) size
  g_cold = argc > 3 && std::strcmp(argv[3], "cold") == 0;
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
