// Attention kernel speed: causal prefill (GFLOP/s against an unfused oneDNN-GEMM
// attention and the machine's f32 GEMM throughput), decode against a KV cache, and a
// training-shape forward + backward.
// Usage: attention_bench [min_seconds_per_measurement=0.3] [rounds=3]
// Every figure is the median over `rounds` runs of each run's median call.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <tuple>
#include <vector>

#include "tessera/base/cpu_features.h"
#include "tessera/base/thread_pool.h"
#include "tessera/base/timer.h"
#include "tessera/kernels/attention.h"
#include "tessera/kernels/dispatch.h"
#include "tessera/kernels/matmul.h"
#include "tessera/kernels/peak.h"
#include "tessera/tensor/tensor.h"

namespace {

using tessera::DType;
using tessera::Tensor;
namespace tk = tessera::kernels;

using tessera::base::median;

double time_call(const std::function<void()>& fn, double min_seconds) {
  return tessera::base::median_call_seconds([&](int64_t) { fn(); }, min_seconds);
}

double median_of_rounds(int rounds, const std::function<double()>& run) {
  std::vector<double> v;
  for (int r = 0; r < rounds; ++r) v.push_back(run());
  return median(v);
}

Tensor random_tensor(const tessera::Shape& shape, uint32_t seed) {
  Tensor t = Tensor::empty(shape, DType::kF32);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = dist(rng);
  return t;
}

// q, k, v as column slices of one fused (B*T, (Hq + 2 Hkv) D) buffer, as the model has them.
struct Fused {
  Tensor qkv, q, k, v;
};
Fused make_fused(int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D) {
  Fused f;
  const int64_t W = (Hq + 2 * Hkv) * D;
  f.qkv = random_tensor({B * T, W}, 1);
  f.q = f.qkv.as_strided({B, T, Hq, D}, {T * W, W, D, 1}, 0);
  f.k = f.qkv.as_strided({B, T, Hkv, D}, {T * W, W, D, 1}, Hq * D);
  f.v = f.qkv.as_strided({B, T, Hkv, D}, {T * W, W, D, 1}, (Hq + Hkv) * D);
  return f;
}

// The textbook way with library GEMMs: per head S = scale Q K^T (T, T) materialised,
// causal softmax, O = P V. B = 1.
void unfused_attention(const Fused& f, Tensor& out, Tensor& scores, float scale) {
  const int64_t T = f.q.size(1), Hq = f.q.size(2), Hkv = f.k.size(2), D = f.q.size(3);
  const int64_t W = f.qkv.size(1), Wo = out.size(2) * D;
  for (int64_t h = 0; h < Hq; ++h) {
    const int64_t kvh = h / (Hq / Hkv);
    const Tensor qh = f.qkv.as_strided({T, D}, {W, 1}, h * D);
    const Tensor kh = f.qkv.as_strided({T, D}, {W, 1}, (Hq + kvh) * D);
    const Tensor vh = f.qkv.as_strided({T, D}, {W, 1}, (Hq + Hkv + kvh) * D);
    tk::matmul(qh, kh, scores, false, true, scale, 0.f);
    float* s = scores.data<float>();
    for (int64_t i = 0; i < T; ++i) {
      float* row = s + i * T;
      float mx = -INFINITY;
      for (int64_t j = 0; j <= i; ++j) mx = std::max(mx, row[j]);
      float sum = 0;
      for (int64_t j = 0; j <= i; ++j) sum += (row[j] = std::exp(row[j] - mx));
      const float inv = 1.f / sum;
      for (int64_t j = 0; j <= i; ++j) row[j] *= inv;
      for (int64_t j = i + 1; j < T; ++j) row[j] = 0.f;
    }
    Tensor oh = out.as_strided({T, D}, {Wo, 1}, h * D);
    tk::matmul(scores, vh, oh, false, false, 1.f, 0.f);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const double min_s = argc > 1 ? std::atof(argv[1]) : 0.3;
  const int rounds = argc > 2 ? std::max(1, std::atoi(argv[2])) : 3;
  std::printf("cpu: %s, threads: %d\n", tessera::base::describe_cpu_features().c_str(),
              tessera::base::num_threads());

  // Prefill: B=1, T=512, Hq=32, Hkv=4, D=64, causal. Flops counted for the visible half.
  {
    const int64_t T = 512, Hq = 32, Hkv = 4, D = 64;
    Fused f = make_fused(1, T, Hq, Hkv, D);
    Tensor out = Tensor::empty({1, T, Hq, D}, DType::kF32);
    Tensor lse = Tensor::empty({1, Hq, T}, DType::kF32);
    Tensor scores = Tensor::empty({T, T}, DType::kF32);
    tk::AttentionParams p;
    p.scale = 1.f / std::sqrt(float(D));
    const double flops = 4.0 * T * T * D * Hq / 2;
    const double ours = median_of_rounds(rounds, [&] {
      return time_call([&] { tk::attention_forward(f.q, f.k, f.v, out, &lse, p); }, min_s);
    });
    const double unfused = median_of_rounds(rounds, [&] {
      return time_call([&] { unfused_attention(f, out, scores, p.scale); }, min_s);
    });
    const double gemm = median_of_rounds(rounds, [&] {
      return tk::measure_matmul_gflops(1024, 1024, 1024, DType::kF32, tk::MatmulBackend::kOneDnn,
                                       min_s)
          .gflops;
    });
    std::printf("prefill T=%lld Hq=%lld Hkv=%lld D=%lld causal: %.2f ms, %.1f GFLOP/s\n",
                (long long)T, (long long)Hq, (long long)Hkv, (long long)D, ours * 1e3,
                flops / ours * 1e-9);
    std::printf("  unfused oneDNN GEMM + softmax: %.2f ms (%.1f GFLOP/s useful), flash %.2fx\n",
                unfused * 1e3, flops / unfused * 1e-9, unfused / ours);
    std::printf("  oneDNN f32 GEMM 1024^3: %.1f GFLOP/s -> flash reaches %.0f%% of it\n", gemm,
                100.0 * flops / ours * 1e-9 / gemm);
  }

  // Decode: one query against a KV cache (Tcap, 2 * Hkv * D), Hq=32, Hkv=4, D=64.
  for (int64_t Tk : {512, 2048}) {
    const int64_t Hq = 32, Hkv = 4, D = 64, Tcap = 4096, Wkv = 2 * Hkv * D;
    Tensor cache = random_tensor({Tcap, Wkv}, 2);
    Tensor kc = cache.as_strided({1, Tk, Hkv, D}, {Tcap * Wkv, Wkv, D, 1}, 0);
    Tensor vc = cache.as_strided({1, Tk, Hkv, D}, {Tcap * Wkv, Wkv, D, 1}, Hkv * D);
    Tensor q = random_tensor({1, 1, Hq, D}, 3);
    Tensor out = Tensor::empty({1, 1, Hq, D}, DType::kF32);
    tk::AttentionParams p;
    p.scale = 1.f / std::sqrt(float(D));
    p.q_offset = Tk - 1;
    const double t = median_of_rounds(rounds, [&] {
      return time_call([&] { tk::attention_forward(q, kc, vc, out, nullptr, p); }, min_s);
    });
    const double bytes = 2.0 * Tk * Hkv * D * sizeof(float);
    std::printf("decode Tk=%lld Hq=%lld Hkv=%lld D=%lld: %.1f us/layer (K+V read at %.1f GB/s)\n",
                (long long)Tk, (long long)Hq, (long long)Hkv, (long long)D, t * 1e6,
                bytes / t * 1e-9);
  }

  // Training shapes (MHA, D=64, causal forward and backward): GPT-2's 4 x 256 and 1 x 1024,
  // in f32 and with bf16 products (native bf16 training: AMX tiles where the CPU has them).
  for (const auto& [B, T, bf16] : {std::tuple<int64_t, int64_t, bool>{4, 64, false}, {4, 64, true}, {4, 128, false}, {4, 128, true}, {4, 256, false}, {4, 256, true},
                                  {1, 1024, false}, {1, 1024, true}}) {
    if (bf16 && !tk::cpu_has(tk::IsaLevel::kAmx)) continue;  // the f32 kernels run there
    const int64_t H = 12, D = 64;
    Fused f = make_fused(B, T, H, H, D);
    Tensor out = Tensor::empty({B, T, H, D}, DType::kF32);
    Tensor lse = Tensor::empty({B, H, T}, DType::kF32);
    Tensor dout = random_tensor({B, T, H, D}, 4);
    Tensor dqkv = Tensor::empty(f.qkv.shape(), DType::kF32);
    const int64_t W = dqkv.size(1);
    Tensor dq = dqkv.as_strided({B, T, H, D}, {T * W, W, D, 1}, 0);
    Tensor dk = dqkv.as_strided({B, T, H, D}, {T * W, W, D, 1}, H * D);
    Tensor dv = dqkv.as_strided({B, T, H, D}, {T * W, W, D, 1}, 2 * H * D);
    tk::AttentionParams p;
    p.scale = 1.f / std::sqrt(float(D));
    p.bf16_products = bf16;
    const double fwd_flops = 4.0 * B * T * T * D * H / 2, bwd_flops = 2.5 * fwd_flops;
    const double fwd = median_of_rounds(rounds, [&] {
      return time_call([&] { tk::attention_forward(f.q, f.k, f.v, out, &lse, p); }, min_s);
    });
    const double bwd = median_of_rounds(rounds, [&] {
      return time_call(
          [&] { tk::attention_backward(f.q, f.k, f.v, out, lse, dout, dq, dk, dv, p); }, min_s);
    });
    std::printf(
        "train B=%lld T=%lld H=%lld D=%lld causal, %s: fwd %.2f ms (%.1f GFLOP/s), "
        "bwd %.2f ms (%.1f GFLOP/s)\n",
        (long long)B, (long long)T, (long long)H, (long long)D, bf16 ? "bf16 products (AMX)" : "f32",
        fwd * 1e3, fwd_flops / fwd * 1e-9,
        bwd * 1e3, bwd_flops / bwd * 1e-9);
  }
  return 0;
}
