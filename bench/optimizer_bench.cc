// Optimizer-step speed: the fused AdamW pass (alone, and as the trainer runs it under
// native bf16: clip coefficient and weight copies in the same pass), the gradient norm and the loss-scaler
// unscale over a GPT-2-124M-sized parameter set, as bandwidth against the machine's
// STREAM triad measured in the same run. All three are memory-bound passes.
// Then Newton-Schulz (Muon) on GPT-2 124M's hidden matrix shapes, as GFLOP/s.
// Usage: optimizer_bench [n_params=124439808] [min_seconds=1.0] [rounds=3]
// Every figure is the median over `rounds` rounds of each round's median call; the
// ratio is the median of per-round ratios.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <vector>

#include "tessera/base/thread_pool.h"
#include "tessera/base/timer.h"
#include "tessera/kernels/peak.h"
#include "tessera/train/grad_utils.h"
#include "tessera/train/loss_scaler.h"
#include "tessera/train/optimizer.h"

namespace {

using tessera::DType;
using tessera::Tensor;
namespace tt = tessera::train;

Tensor random_f32(int64_t n, float scale, uint32_t seed) {
  Tensor t = Tensor::empty({n}, DType::kF32);
  float* p = t.data<float>();
  tessera::base::parallel_for(n, int64_t{1} << 20, [&](int64_t b, int64_t e) {
    std::mt19937 rng(seed + static_cast<uint32_t>(b >> 20));
    std::normal_distribution<float> d(0.f, scale);
    for (int64_t i = b; i < e; ++i) p[i] = d(rng);
  });
  return t;
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t n = argc > 1 ? std::atoll(argv[1]) : int64_t{124439808};
  const double min_s = argc > 2 ? std::atof(argv[2]) : 1.0;
  const int rounds = argc > 3 ? std::atoi(argv[3]) : 3;
  std::printf("optimizer_bench: %lld params, %d threads, median of %d rounds\n",
              static_cast<long long>(n), tessera::base::num_threads(), rounds);

  // One flat tensor: the step splits it into the same 64K-element chunks it would
  // split 150 separate tensors into, so the shape of the model does not matter here.
  tt::ParamRef w;
  w.name = "w", w.param = random_f32(n, 0.02f, 1), w.grad = random_f32(n, 1e-3f, 2), w.decay = true;
  std::vector<tt::ParamRef> ps = {w};
  tt::Optimizer opt(tt::OptimizerConfig{}, ps);
  tt::LossScaler scaler(1.0);  // scale 1 keeps the grads unchanged across calls
  // The trainer's update under native bf16 (train::update_weights): the clip coefficient
  // applied in the pass and the weights' rounded f32 and bf16 copies written by it.
  std::vector<tt::ParamCopies> copies(1);
  copies[0].rounded = Tensor::empty({n}, DType::kF32);
  copies[0].bf16 = Tensor::empty({n}, DType::kBF16);
  tt::StepOptions fused;
  fused.grad_scale = 0.5;
  fused.copies = &copies;

  struct Row {
    const char* name;
    double bytes_per_elem;  // compulsory traffic, STREAM convention (no write-allocate)
    std::function<void()> fn;
  };
  const std::vector<Row> rows = {
      {"adamw step (auto ISA)", 28, [&] { opt.step(1.0); }},
      {"adamw + clip + copies", 34, [&] { opt.step(1.0, fused); }},
      {"adamw step (avx2)", 28,
       [&] {
         tt::set_adamw_kernel_for_testing(tt::AdamWKernel::kAvx2);
         opt.step(1.0);
         tt::set_adamw_kernel_for_testing(tt::AdamWKernel::kAuto);
       }},
      {"adamw step (portable)", 28,
       [&] {
         tt::set_adamw_kernel_for_testing(tt::AdamWKernel::kPortable);
         opt.step(1.0);
         tt::set_adamw_kernel_for_testing(tt::AdamWKernel::kAuto);
       }},
      {"grad global norm", 4, [&] { tt::grad_global_norm(ps); }},
      {"loss-scaler unscale", 8, [&] { scaler.unscale_and_check(ps); }},
  };
  // STREAM is re-measured in every round, next to the passes it is compared with, so
  // load from other users of a shared machine hits both sides of each ratio alike.
  std::vector<double> stream;
  std::vector<std::vector<double>> secs(rows.size());
  for (int round = 0; round < rounds; ++round) {
    stream.push_back(tessera::kernels::measure_stream_triad_gbps());
    for (size_t k = 0; k < rows.size(); ++k)
      secs[k].push_back(tessera::base::median_call_seconds([&](int64_t) { rows[k].fn(); }, min_s));
  }
  std::printf("STREAM triad: %.2f GB/s (median; rounds:", tessera::base::median(stream));
  for (double g : stream) std::printf(" %.2f", g);
  std::printf(")\n\n%-24s %10s %12s %10s %12s\n", "pass", "ms/call", "Gelem/s", "GB/s",
              "vs STREAM");
  for (size_t k = 0; k < rows.size(); ++k) {
    std::vector<double> ratio;
    for (int round = 0; round < rounds; ++round)
      ratio.push_back(rows[k].bytes_per_elem * double(n) / secs[k][round] / 1e9 / stream[round]);
    const double s = tessera::base::median(secs[k]);
    const double gbps = rows[k].bytes_per_elem * double(n) / s / 1e9;
    std::printf("%-24s %10.2f %12.3f %10.2f %12.2f\n", rows[k].name, s * 1e3, double(n) / s / 1e9,
                gbps, tessera::base::median(ratio));
  }

  // Muon's cost does not depend on the batch: 5 Newton-Schulz iterations of
  // 4 r^2 c + 2 r^3 flops for each (r <= c) hidden matrix. GPT-2 124M block shapes:
  std::printf("\n%-24s %10s %12s\n", "newton_schulz5 (f32)", "ms/call", "GFLOP/s");
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{2304, 768}, {768, 768}, {3072, 768}, {768, 3072}};
  double block_ms = 0;
  for (const auto& [rows, cols] : shapes) {
    const Tensor g = random_f32(rows * cols, 1.f, 3).view({rows, cols});
    const double r = double(std::min(rows, cols)), c = double(std::max(rows, cols));
    std::vector<double> t;
    for (int round = 0; round < rounds; ++round)
      t.push_back(tessera::base::median_call_seconds([&](int64_t) { tt::newton_schulz5(g, 5); }, min_s));
    const double s = tessera::base::median(t);
    block_ms += s * 1e3;
    char name[32];
    std::snprintf(name, sizeof(name), "(%lld, %lld)", static_cast<long long>(rows), static_cast<long long>(cols));
    std::printf("%-24s %10.2f %12.1f\n", name, s * 1e3, 5 * (4 * r * r * c + 2 * r * r * r) / s / 1e9);
  }
  std::printf("one GPT-2 block's four matrices: %.0f ms; x12 blocks: %.2f s per Muon step\n", block_ms,
              12 * block_ms / 1e3);
  return 0;
}
