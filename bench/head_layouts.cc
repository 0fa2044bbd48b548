// The vocabulary head's three GEMMs of a training step (GPT-2 124M, 4 x 64 tokens) in each
// operand layout kernels::matmul can be handed, with the caches flushed before every call
// as they are in a step (the 77 MB bf16 head never stays cached between its uses):
//   forward  logits (N, V) = h W^T          or  logits^T (V, N) = W h^T
//   dgrad    dh (N, H)     = dlogits W       from dlogits (N, V) or dlogits^T (V, N)
//   wgrad    dW (V, H)     = dlogits^T h     from dlogits (N, V) or dlogits^T (V, N)
// The layout that reads the head once, unpacked, as oneDNN's A operand wins where packing
// the big operand (AMX's VNNI B layout) costs more than the product.
// Usage: head_layouts [f32|bf16] [VOCAB=50257] [REPEATS=5]
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "bench_util.h"
#include "tessera/base/timer.h"
#include "tessera/kernels/matmul.h"

using namespace tessera;

namespace {

Tensor filled(Shape shape, DType dt, float v) {
  Tensor t = Tensor::empty(shape, DType::kF32);
  t.fill(v);
  return t.to(dt);
}

// Median of `repeats` calls with the caches flushed before each (cold), and of as many
// back to back (warm).
void time_case(const char* what, const Tensor& a, const Tensor& b, Tensor& c, bool ta, bool tb,
               int repeats) {
  const int64_t m = c.size(0), n = c.size(1), k = ta ? a.size(0) : a.size(1);
  const double flop = 2.0 * m * n * k;
  kernels::matmul(a, b, c, ta, tb);  // primitive creation
  std::vector<double> cold, warm;
  for (int i = 0; i < repeats; ++i) {
    tessera::bench::flush_caches();
    base::Timer t;
    kernels::matmul(a, b, c, ta, tb);
    cold.push_back(t.seconds());
  }
  for (int i = 0; i < repeats; ++i) {
    base::Timer t;
    kernels::matmul(a, b, c, ta, tb);
    warm.push_back(t.seconds());
  }
  const double mc = base::median(cold), mw = base::median(warm);
  std::printf("%-40s cold %8.2f ms %6.0f GFLOP/s | warm %8.2f ms %6.0f GFLOP/s\n", what, mc * 1e3,
              flop / mc / 1e9, mw * 1e3, flop / mw / 1e9);
}

}  // namespace

int main(int argc, char** argv) {
  DType dt = DType::kBF16;
  if (argc > 1 && std::strcmp(argv[1], "f32") == 0) dt = DType::kF32;
  else if (argc > 1 && std::strcmp(argv[1], "bf16") != 0) {
    std::fprintf(stderr, "head_layouts: operand dtype must be f32 or bf16, got '%s'\n", argv[1]);
    return 2;
  }
  const int64_t N = 256, H = 768;
  const int64_t V = argc > 2 ? std::atoll(argv[2]) : 50257;
  const int repeats = argc > 3 ? std::atoi(argv[3]) : 5;
  if (V < 1 || repeats < 1) {
    std::fprintf(stderr, "head_layouts: VOCAB and REPEATS must be positive\n");
    return 2;
  }
  std::printf("lm head, %s operands, N %lld, H %lld, V %lld (median of %d cold calls)\n",
              dtype_name(dt), (long long)N, (long long)H, (long long)V, repeats);
  const Tensor w = filled({V, H}, dt, 0.02f), h = filled({N, H}, dt, 0.01f);
  const Tensor dl = filled({N, V}, dt, 1e-3f), dlt = filled({V, N}, dt, 1e-3f);
  Tensor logits = Tensor::empty({N, V}, DType::kF32), logits_t = Tensor::empty({V, N}, DType::kF32);
  Tensor dh = Tensor::empty({N, H}, DType::kF32), dh_t = Tensor::empty({H, N}, DType::kF32);
  Tensor dw = Tensor::empty({V, H}, DType::kF32);
  time_case("forward  h W^T       -> (N, V)", h, w, logits, false, true, repeats);
  time_case("forward  W h^T       -> (V, N)", w, h, logits_t, false, true, repeats);
  time_case("dgrad    dl W        [dl (N, V)]", dl, w, dh, false, false, repeats);
  time_case("dgrad    dl W        [dl^T (V, N)]", dlt, w, dh, true, false, repeats);
  time_case("dgrad    W^T dl^T    -> (H, N)", w, dlt, dh_t, true, false, repeats);
  time_case("wgrad    dl^T h      [dl (N, V)]", dl, h, dw, true, false, repeats);
  time_case("wgrad    dl^T h      [dl^T (V, N)]", dlt, h, dw, false, false, repeats);
  // GPT-2's block linears (Conv1D weights stored (in, out)) for comparison.
  const int64_t F = 4 * H;
  for (const auto& [name, in, out] : {std::tuple{"c_attn", H, 3 * H}, std::tuple{"attn.c_proj", H, H},
                                      std::tuple{"c_fc", H, F}, std::tuple{"mlp.c_proj", F, H}}) {
    const Tensor wb = filled({in, out}, dt, 0.02f), x = filled({N, in}, dt, 0.01f);
    const Tensor dy = filled({N, out}, dt, 1e-3f);
    Tensor y = Tensor::empty({N, out}, DType::kF32), dx = Tensor::empty({N, in}, DType::kF32);
    Tensor g = Tensor::empty({in, out}, DType::kF32);
    const std::string n = name;
    time_case(("block " + n + " forward").c_str(), x, wb, y, false, false, repeats);
    time_case(("block " + n + " dgrad").c_str(), dy, wb, dx, false, true, repeats);
    time_case(("block " + n + " wgrad").c_str(), x, dy, g, true, false, repeats);
  }
  return 0;
}
