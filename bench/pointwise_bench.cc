// Pointwise kernel speed (norms, activations, RoPE, embedding, cross-entropy): achieved
// bandwidth of the AVX-512 and portable paths against the machine's STREAM triad
// bandwidth measured in the same run. These kernels are memory-bound except the
// exp-heavy ones (softmax, GELU, SwiGLU, cross-entropy), where ns / element is shown too.
// Tensors are 8M floats (32 MB): on a CPU whose L3 holds them, a ratio above 1 means the
// data came from L3 rather than DRAM (STREAM's arrays are 128 MB each).
// Usage: pointwise_bench [min_seconds_per_measurement=0.3] [rounds=3]
// Every figure is the median over `rounds` runs of each run's median call.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <vector>

#include "tessera/base/cpu_features.h"
#include "tessera/base/thread_pool.h"
#include "tessera/base/timer.h"
#include "tessera/kernels/activation.h"
#include "tessera/kernels/cpu/pointwise_common.h"
#include "tessera/kernels/cross_entropy.h"
#include "tessera/kernels/elementwise.h"
#include "tessera/kernels/embedding.h"
#include "tessera/kernels/norm.h"
#include "tessera/kernels/peak.h"
#include "tessera/kernels/rope.h"
#include "tessera/tensor/tensor.h"

namespace {

using tessera::DType;
using tessera::Tensor;
namespace tk = tessera::kernels;

using tessera::base::median;

double time_call(const std::function<void()>& fn, double min_seconds) {
  return tessera::base::median_call_seconds([&](int64_t) { fn(); }, min_seconds);
}

Tensor random_f32(const tessera::Shape& shape, float lo, float hi, uint32_t seed) {
  Tensor t = Tensor::empty(shape, DType::kF32);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = u(rng);
  return t;
}

struct Op {
  const char* name;
  double bytes;     // compulsory traffic per call
  double elements;  // elements processed per call
  std::function<void()> fn;
};

}  // namespace

int main(int argc, char** argv) {
  const double min_s = argc > 1 ? std::atof(argv[1]) : 0.3;
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 3;
  const int64_t N = 2048, H = 4096, F = 11008, R = 64, V = 50257, head_dim = 128;
  std::printf("cpu: %s, threads: %d\n", tessera::base::describe_cpu_features().c_str(),
              tessera::base::num_threads());

  Tensor x = random_f32({N, H}, -2, 2, 1), dout = random_f32({N, H}, -1, 1, 2);
  Tensor out = Tensor::empty({N, H}, DType::kF32), dx = out.clone();
  Tensor w = random_f32({H}, 0.5f, 1.5f, 3), b = random_f32({H}, -0.1f, 0.1f, 4);
  Tensor dw = Tensor::zeros({H}, DType::kF32), db = dw.clone();
  Tensor mean = Tensor::empty({N}, DType::kF32), rstd = mean.clone();
  Tensor gate = random_f32({N / 4, F}, -4, 4, 5), up = random_f32({N / 4, F}, -1, 1, 6);
  Tensor act = Tensor::empty({N / 4, F}, DType::kF32);
  Tensor logits = random_f32({R, V}, -10, 10, 7), dlogits = logits.clone();
  std::vector<int32_t> ids(N), targets(R);
  for (int64_t i = 0; i < N; ++i) ids[i] = static_cast<int32_t>((i * 7919) % V);
  for (int64_t i = 0; i < R; ++i) targets[i] = static_cast<int32_t>((i * 104729) % V);
  Tensor pos = Tensor::from_vector(ids, {N}), tok = pos;
  Tensor tgt = Tensor::from_vector(targets, {R});
  Tensor table = random_f32({V, H / 4}, -1, 1, 8), emb = Tensor::empty({N, H / 4}, DType::kF32);
  ids.clear();

  const double nh = double(N) * H * 4, nf = double(N / 4) * F * 4, nv = double(R) * V * 4;
  const std::vector<Op> ops = {
      {"rmsnorm_forward", 2 * nh, double(N) * H,
       [&] { tk::rmsnorm_forward(x, w, 1e-5f, out, &rstd); }},
      {"rmsnorm_backward", 3 * nh, double(N) * H,
       [&] { tk::rmsnorm_backward(dout, x, w, rstd, dx, dw); }},
      {"layernorm_forward", 2 * nh, double(N) * H,
       [&] { tk::layernorm_forward(x, w, b, 1e-5f, out, &mean, &rstd); }},
      {"layernorm_backward", 3 * nh, double(N) * H,
       [&] { tk::layernorm_backward(dout, x, w, mean, rstd, dx, dw, db); }},
      {"add_inplace", 3 * nh, double(N) * H, [&] { tk::add_inplace(out, dout); }},
      {"rope_apply", 2 * nh, double(N) * H, [&] { tk::rope_apply(out, head_dim, pos, 1e4f); }},
      {"gelu_forward", 2 * nf, double(N / 4) * F, [&] { tk::gelu_forward(gate, act); }},
      {"swiglu_forward", 3 * nf, double(N / 4) * F, [&] { tk::swiglu_forward(gate, up, act); }},
      {"softmax_forward", 2 * nh, double(N) * H, [&] { tk::softmax_forward(x, out); }},
      {"cross_entropy+grad", 2 * nv, double(R) * V,
       [&] { tk::cross_entropy(logits, tgt, nullptr, &dlogits, 1.0f / R); }},
      {"embedding_forward", 2.0 * N * (H / 4) * 4, double(N) * (H / 4),
       [&] { tk::embedding_forward(table, tok, emb); }},
  };

  std::vector<double> stream;
  for (int r = 0; r < rounds; ++r) stream.push_back(tk::measure_stream_triad_gbps());
  const double peak = median(stream);
  std::printf("STREAM triad: %.1f GB/s\n\n", peak);
  std::printf("%-20s %-7s %9s %8s %9s %8s\n", "op", "path", "ms", "GB/s", "vs STREAM",
              "ns/elem");
  for (const Op& op : ops) {
    for (auto isa : {tk::cpu::Isa::kAvx512, tk::cpu::Isa::kScalar}) {
      tk::cpu::set_pointwise_isa_for_testing(isa);
      if (isa == tk::cpu::Isa::kAvx512 && !tk::cpu::use_avx512()) continue;
      std::vector<double> t;
      for (int r = 0; r < rounds; ++r) t.push_back(time_call(op.fn, min_s));
      const double s = median(t);
      std::printf("%-20s %-7s %9.3f %8.1f %9.2f %8.2f\n", op.name,
                  isa == tk::cpu::Isa::kAvx512 ? "avx512" : "scalar", s * 1e3,
                  op.bytes / s / 1e9, op.bytes / s / 1e9 / peak, s / op.elements * 1e9);
    }
  }
  tk::cpu::set_pointwise_isa_for_testing(tk::cpu::Isa::kAvx512);
  return 0;
}
