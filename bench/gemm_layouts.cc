// oneDNN's two f32 GEMM engines on the shapes of a training step: the matmul primitive
// (which oneDNN 2.6 runs with its brgemm kernels here) against its BLAS-style sgemm
// (gemm:jit), for b as (N, K) and as (K, N). kernels::matmul picks sgemm when b is (K, N)
// and the primitive when b is (N, K); this program is the measurement behind that rule.
// Usage: gemm_layouts [rounds=3]
// Each figure is the median over `rounds` interleaved rounds of each round's median call
// (base::median_call_seconds, at least 0.2 s and 5 calls).
#include <oneapi/dnnl/dnnl.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "tessera/base/thread_pool.h"
#include "tessera/base/timer.h"

namespace {

using dnnl::memory;
using tessera::base::median;

constexpr double kMinSeconds = 0.2;  // per engine, shape and round

struct Shape {
  const char* name;
  int64_t m, n, k;
  bool ta, tb;
  float beta;
};

memory::desc desc(int64_t rows, int64_t cols, bool trans) {
  return trans ? memory::desc({rows, cols}, memory::data_type::f32, {1, rows})
               : memory::desc({rows, cols}, memory::data_type::f32, {cols, 1});
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::max(1, std::atoi(argv[1])) : 3;
  tessera::base::num_threads();  // applies TESSERA_NUM_THREADS to oneDNN's OpenMP team
  const int64_t T = 256, H = 768, F = 3072, V = 50257;  // GPT-2 124M, batch 4 x 64
  const int64_t S = 512, D = 2048, G = 5632;            // Llama "1b", 512 tokens
  const std::vector<Shape> shapes = {
      {"gpt2 fwd c_attn", T, 3 * H, H, false, false, 0}, {"gpt2 fwd c_fc", T, F, H, false, false, 0},
      {"gpt2 fwd mlp.c_proj", T, H, F, false, false, 0}, {"gpt2 fwd lm_head", T, V, H, false, true, 0},
      {"gpt2 dx c_fc", T, H, F, false, true, 0},         {"gpt2 dx mlp.c_proj", T, F, H, false, true, 0},
      {"gpt2 dx lm_head", T, H, V, false, false, 0},     {"gpt2 dW c_attn", H, 3 * H, T, true, false, 1},
      {"gpt2 dW c_fc", H, F, T, true, false, 1},         {"gpt2 dW lm_head", V, H, T, true, false, 1},
      {"1b fwd up", S, G, D, false, true, 0},            {"1b fwd down", S, D, G, false, true, 0},
      {"1b dx up", S, D, G, false, false, 0},            {"1b dx down", S, G, D, false, false, 0},
      {"1b dW up", G, D, S, true, false, 1},             {"1b dW down", D, G, S, true, false, 1},
  };
  dnnl::engine eng(dnnl::engine::kind::cpu, 0);
  dnnl::stream stream(eng);
  std::vector<std::vector<double>> prim(shapes.size()), sgemm(shapes.size());
  for (int r = 0; r < rounds; ++r) {
    for (size_t i = 0; i < shapes.size(); ++i) {
      const Shape& s = shapes[i];
      std::vector<float> a(s.m * s.k, 0.01f), b(s.k * s.n, 0.02f), c(s.m * s.n, 0.f);
      const memory::desc a_md = desc(s.m, s.k, s.ta), b_md = desc(s.k, s.n, s.tb);
      const memory::desc c_md({s.m, s.n}, memory::data_type::f32, {s.n, 1});
      dnnl::primitive_attr attr;
      if (s.beta != 0) {
        dnnl::post_ops ops;
        ops.append_sum(s.beta);
        attr.set_post_ops(ops);
      }
      const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a_md, b_md, c_md), attr, eng);
      dnnl::matmul p(pd);
      memory am(a_md, eng, a.data()), bm(b_md, eng, b.data()), cm(c_md, eng, c.data());
      prim[i].push_back(tessera::base::median_call_seconds(
          [&](int64_t) {
            p.execute(stream, {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}});
            stream.wait();
          },
          kMinSeconds));
      sgemm[i].push_back(tessera::base::median_call_seconds(
          [&](int64_t) {
            dnnl_sgemm(s.ta ? 'T' : 'N', s.tb ? 'T' : 'N', s.m, s.n, s.k, 1.f, a.data(), s.ta ? s.m : s.k,
                       b.data(), s.tb ? s.k : s.n, s.beta, c.data(), s.n);
          },
          kMinSeconds));
    }
  }
  std::printf("%-22s %6s %6s %6s %4s  %10s %10s  %s\n", "shape", "m", "n", "k", "b", "primitive",
              "sgemm", "sgemm / primitive (Tessera uses)");
  for (size_t i = 0; i < shapes.size(); ++i) {
    const Shape& s = shapes[i];
    const double gflop = 2.0 * s.m * s.n * s.k / 1e9;
    const double tp = median(prim[i]), ts = median(sgemm[i]);
    std::printf("%-22s %6lld %6lld %6lld %4s  %10.0f %10.0f  %.2fx (%s)\n", s.name, (long long)s.m,
                (long long)s.n, (long long)s.k, s.tb ? "N,K" : "K,N", gflop / tp, gflop / ts, tp / ts,
                s.tb ? "primitive" : "sgemm");
  }
  std::printf("GFLOP/s, f32, %d thread(s), median of %d round(s)\n", tessera::base::num_threads(), rounds);
  return 0;
}
