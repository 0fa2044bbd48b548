// Whether bf16 weights kept in oneDNN's own blocked layout between steps would pay: the
// weight-side GEMMs of a GPT-2 124M step (4 x 64 tokens) through oneDNN's matmul primitive
// with b in the plain layout the model stores (the primitive packs it on every call) against
// b reordered once into the layout the primitive asks for (format_tag::any), caches flushed
// before each call as in a step; and what that reorder costs (it would run once per step,
// when the optimizer publishes the weights).
// Usage: packed_weights [REPEATS=5]
#include <oneapi/dnnl/dnnl.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "tessera/base/thread_pool.h"
#include "bench_util.h"
#include "tessera/base/timer.h"
#include "tessera/kernels/packed_b.h"
#include <cstring>

namespace {

using dnnl::memory;
using tessera::base::median;

struct Shape {
  const char* name;
  int64_t m, n, k;
  bool tb;  // b stored (N, K), as a Hugging Face (out, in) weight seen by x W^T
};

// Row-major (rows, cols) bf16, or its transpose's storage when `trans`.
memory::desc plain(int64_t rows, int64_t cols, bool trans) {
  return trans ? memory::desc({rows, cols}, memory::data_type::bf16, {1, rows})
               : memory::desc({rows, cols}, memory::data_type::bf16, {cols, 1});
}

}  // namespace

int main(int argc, char** argv) {
  const int repeats = argc > 1 ? std::max(1, std::atoi(argv[1])) : 5;
  tessera::base::num_threads();
  const int64_t T = 256, H = 768, F = 3072, V = 50257;
  // GPT-2's Conv1D weights are (in, out): forward b = W (K, N), input gradient b = W^T.
  const std::vector<Shape> shapes = {
      {"fwd c_attn", T, 3 * H, H, false},   {"fwd attn.c_proj", T, H, H, false},
      {"fwd c_fc", T, F, H, false},         {"fwd mlp.c_proj", T, H, F, false},
      {"dx c_attn", T, H, 3 * H, true},     {"dx attn.c_proj", T, H, H, true},
      {"dx c_fc", T, H, F, true},           {"dx mlp.c_proj", T, F, H, true},
      {"fwd lm_head", T, V, H, true},       {"dx lm_head", T, H, V, false},
  };
  dnnl::engine eng(dnnl::engine::kind::cpu, 0);
  dnnl::stream stream(eng);
  std::printf("%-16s %6s %6s %6s | %9s %9s | %9s %9s | %8s %8s %6s\n", "shape", "m", "n", "k", "plain ms",
              "packed ms", "plain GF", "packed GF", "reorder", "ours ms", "gain");
  double plain_total = 0, packed_total = 0, pack_total = 0, ours_total = 0;
  for (const Shape& s : shapes) {
    std::vector<uint16_t> a(s.m * s.k, 0x3c23), b(s.k * s.n, 0x3ca3);  // ~0.01, ~0.02
    std::vector<float> c(s.m * s.n);
    const memory::desc a_md = plain(s.m, s.k, false), b_md = plain(s.k, s.n, s.tb);
    const memory::desc c_md({s.m, s.n}, memory::data_type::f32, {s.n, 1});
    const memory::desc any_md({s.k, s.n}, memory::data_type::bf16, memory::format_tag::any);
    const dnnl::matmul::primitive_desc pd_plain(dnnl::matmul::desc(a_md, b_md, c_md), eng);
    const dnnl::matmul::primitive_desc pd_any(dnnl::matmul::desc(a_md, any_md, c_md), eng);
    dnnl::matmul p_plain(pd_plain), p_any(pd_any);
    memory am(a_md, eng, a.data()), bm(b_md, eng, b.data()), cm(c_md, eng, c.data());
    memory bp(pd_any.weights_desc(), eng);
    dnnl::reorder ro(bm, bp);
    auto time = [&](auto&& fn) {
      fn();
      std::vector<double> t;
      for (int i = 0; i < repeats; ++i) {
        tessera::bench::flush_caches();
        tessera::base::Timer timer;
        fn();
        t.push_back(timer.seconds());
      }
      return median(t);
    };
    const double tp = time([&] {
      p_plain.execute(stream, {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}});
      stream.wait();
    });
    const double tr = time([&] {
      ro.execute(stream, bm, bp);
      stream.wait();
    });
    // Our packer (kernels/packed_b.h), what the model runs when it refreshes its copies.
    tessera::Tensor w = tessera::Tensor::empty(s.tb ? tessera::Shape{s.n, s.k} : tessera::Shape{s.k, s.n},
                                               tessera::DType::kBF16);
    std::memcpy(w.raw_data(), b.data(), b.size() * 2);
    tessera::kernels::PackedB ours;
    const double to = time([&] { tessera::kernels::pack_b(w, s.tb, ours); });
    const double tq = time([&] {
      p_any.execute(stream, {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bp}, {DNNL_ARG_DST, cm}});
      stream.wait();
    });
    const double gf = 2.0 * s.m * s.n * s.k / 1e9;
    const int mult = s.n == V || s.k == V ? 1 : 12;
    plain_total += mult * tp, packed_total += mult * tq, pack_total += mult * tr, ours_total += mult * to;
    std::printf("%-16s %6lld %6lld %6lld | %9.3f %9.3f | %9.0f %9.0f | %8.3f %8.3f %5.2fx\n", s.name,
                (long long)s.m, (long long)s.n, (long long)s.k, tp * 1e3, tq * 1e3, gf / tp, gf / tq,
                tr * 1e3, to * 1e3, tp / tq);
  }
  std::printf("per step (12 layers + head): plain %.1f ms, packed %.1f ms, oneDNN reorders %.1f ms, "
              "our packer %.1f ms; %d thread(s), median of %d cold calls\n",
              plain_total * 1e3, packed_total * 1e3, pack_total * 1e3, ours_total * 1e3, tessera::base::num_threads(),
              repeats);
  return 0;
}
