// Paged attention speed against the dense attention_forward on the same shapes (keys in
// one contiguous cache per sequence): decodes at batch 1 / 16 over contexts 512 / 2048
// (GB/s of K + V read) and a 256-token prefill chunk over 1024 cached tokens (GFLOP/s);
// then the batch-16 decodes from each KV cache dtype (f32, bf16, int8, fp8: bytes as
// stored, and time per call against f32's).
// Usage: paged_attention_bench [min_seconds_per_measurement=0.1] [rounds=7]
// Every figure is the median over `rounds` runs of each run's median call.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <numeric>
#include <random>
#include <vector>

#include "tessera/base/cpu_features.h"
#include "tessera/base/thread_pool.h"
#include "tessera/base/timer.h"
#include "tessera/kernels/attention.h"
#include "tessera/kernels/paged_attention.h"
#include "tessera/tensor/tensor.h"

namespace {

using tessera::DType;
using tessera::Tensor;
namespace tk = tessera::kernels;

constexpr int64_t kHq = 32, kHkv = 4, kD = 64, kBlock = 16;

double time_call(const std::function<void()>& fn, double min_seconds) {
  return tessera::base::median_call_seconds([&](int64_t) { fn(); }, min_seconds);
}

Tensor random_tensor(const tessera::Shape& shape, uint32_t seed) {
  Tensor t = Tensor::empty(shape, DType::kF32);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = dist(rng);
  return t;
}

// B sequences of `ctx` keys in a paged cache with shuffled block tables, and the same
// shapes as a dense (B, ctx, 2 Hkv D) cache for attention_forward.
struct Setup {
  Tensor k_cache, v_cache;  // (num_blocks, kBlock, Hkv, D)
  std::vector<std::vector<int32_t>> tables;
  std::vector<tk::PagedSequence> seqs;
  Tensor q, out;            // (B * q_len, Hq, D)
  Tensor dense_kv;          // (B * ctx, 2 Hkv D)
  Tensor dq, dout;          // (B, q_len, Hq, D) views of q, out
  Tensor dk, dv;            // (B, ctx, Hkv, D) views of dense_kv
};

Setup make_setup(int64_t B, int64_t q_len, int64_t ctx) {
  Setup s;
  const int64_t per_seq = (ctx + kBlock - 1) / kBlock, nb = B * per_seq;
  s.k_cache = random_tensor({nb, kBlock, kHkv, kD}, 1);
  s.v_cache = random_tensor({nb, kBlock, kHkv, kD}, 2);
  std::vector<int32_t> perm(nb);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), std::mt19937(3));
  s.tables.resize(B);
  for (int64_t b = 0; b < B; ++b) {
    s.tables[b].assign(perm.begin() + b * per_seq, perm.begin() + (b + 1) * per_seq);
    s.seqs.push_back({b * q_len, q_len, ctx, s.tables[b].data()});
  }
  s.q = random_tensor({B * q_len, kHq, kD}, 4);
  s.out = Tensor::empty({B * q_len, kHq, kD}, DType::kF32);
  const int64_t W = 2 * kHkv * kD;
  s.dense_kv = random_tensor({B * ctx, W}, 5);
  s.dq = s.q.view({B, q_len, kHq, kD});
  s.dout = s.out.view({B, q_len, kHq, kD});
  s.dk = s.dense_kv.as_strided({B, ctx, kHkv, kD}, {ctx * W, W, kD, 1}, 0);
  s.dv = s.dense_kv.as_strided({B, ctx, kHkv, kD}, {ctx * W, W, kD, 1}, kHkv * kD);
  return s;
}

struct Times {
  double paged, invariant, dense;
};

Times measure(Setup& s, int64_t q_len, int64_t ctx, double min_s, int rounds) {
  tk::PagedAttentionParams p;
  p.scale = 1.f / std::sqrt(float(kD));
  tk::PagedAttentionParams pi = p;
  pi.batch_invariant = true;
  tk::AttentionParams ap;
  ap.scale = p.scale;
  ap.q_offset = ctx - q_len;
  // Rounds interleave the three variants so load from other users of this shared machine
  // drifts over all of them alike.
  std::vector<double> paged, invariant, dense;
  for (int r = 0; r < rounds; ++r) {
    paged.push_back(time_call(
        [&] { tk::paged_attention(s.q, s.k_cache, s.v_cache, s.seqs, s.out, p); }, min_s));
    invariant.push_back(time_call(
        [&] { tk::paged_attention(s.q, s.k_cache, s.v_cache, s.seqs, s.out, pi); }, min_s));
    dense.push_back(
        time_call([&] { tk::attention_forward(s.dq, s.dk, s.dv, s.dout, nullptr, ap); }, min_s));
  }
  using tessera::base::median;
  return Times{median(paged), median(invariant), median(dense)};
}

}  // namespace

int main(int argc, char** argv) {
  const double min_s = argc > 1 ? std::atof(argv[1]) : 0.1;
  const int rounds = argc > 2 ? std::max(1, std::atoi(argv[2])) : 7;
  std::printf("cpu: %s, threads: %d; Hq=%lld Hkv=%lld D=%lld block=%lld, f32\n",
              tessera::base::describe_cpu_features().c_str(), tessera::base::num_threads(),
              (long long)kHq, (long long)kHkv, (long long)kD, (long long)kBlock);

  for (int64_t B : {1, 16})
    for (int64_t ctx : {512, 2048}) {
      Setup s = make_setup(B, 1, ctx);
      const Times t = measure(s, 1, ctx, min_s, rounds);
      const double bytes = 2.0 * B * ctx * kHkv * kD * sizeof(float);
      std::printf(
          "decode B=%-2lld ctx=%-4lld paged %8.1f us %5.1f GB/s | invariant %8.1f us %5.1f GB/s"
          " | dense attention_forward %8.1f us %5.1f GB/s | paged speed %.2fx dense\n",
          (long long)B, (long long)ctx, t.paged * 1e6, bytes / t.paged * 1e-9, t.invariant * 1e6,
          bytes / t.invariant * 1e-9, t.dense * 1e6, bytes / t.dense * 1e-9, t.dense / t.paged);
    }

  // The cache dtypes: the same keys and values written into each form.
  for (int64_t ctx : {512, 2048}) {
    const int64_t B = 16;
    Setup s = make_setup(B, 1, ctx);
    const int64_t nb = s.k_cache.size(0);
    // Every block's rows as one sequence of keys in block order, to write them.
    std::vector<int32_t> all(nb);
    std::iota(all.begin(), all.end(), 0);
    const std::vector<tk::PagedSequence> whole{{0, nb * kBlock, nb * kBlock, all.data()}};
    const Tensor k = s.k_cache.view({nb * kBlock, kHkv, kD}), v = s.v_cache.view({nb * kBlock, kHkv, kD});
    tk::PagedAttentionParams p;
    p.scale = 1.f / std::sqrt(float(kD));
    double f32_time = 0;
    for (auto dt : {tk::KvCacheDtype::kF32, tk::KvCacheDtype::kBF16, tk::KvCacheDtype::kInt8, tk::KvCacheDtype::kFp8}) {
      Tensor kc = tk::make_kv_cache(nb, kBlock, kHkv, kD, dt), vc = tk::make_kv_cache(nb, kBlock, kHkv, kD, dt);
      tk::write_kv_cache(k, v, whole, kc, vc);
      std::vector<double> t;
      for (int r = 0; r < rounds; ++r)
        t.push_back(time_call([&] { tk::paged_attention(s.q, kc, vc, s.seqs, s.out, p); }, min_s));
      const double sec = tessera::base::median(t);
      if (dt == tk::KvCacheDtype::kF32) f32_time = sec;
      const double bytes = 2.0 * B * ctx * kHkv * tk::kv_cache_row_bytes(dt, kD);
      std::printf("decode B=16 ctx=%-4lld kv %-4s %8.1f us %5.1f GB/s as stored | %.2fx f32's time\n", (long long)ctx,
                  tk::kv_cache_dtype_name(dt), sec * 1e6, bytes / sec * 1e-9, sec / f32_time);
    }
  }

  {
    const int64_t chunk = 256, cached = 1024, ctx = cached + chunk;
    Setup s = make_setup(1, chunk, ctx);
    const Times t = measure(s, chunk, ctx, min_s, rounds);
    double keys = 0;  // visible keys summed over the chunk's rows
    for (int64_t i = 0; i < chunk; ++i) keys += cached + i + 1;
    const double flops = 4.0 * keys * kD * kHq;
    std::printf(
        "prefill chunk=%lld over %lld cached: paged %.2f ms %.1f GFLOP/s | invariant %.2f ms "
        "%.1f GFLOP/s | dense attention_forward %.2f ms %.1f GFLOP/s | paged speed %.2fx dense\n",
        (long long)chunk, (long long)cached, t.paged * 1e3, flops / t.paged * 1e-9,
        t.invariant * 1e3, flops / t.invariant * 1e-9, t.dense * 1e3, flops / t.dense * 1e-9,
        t.dense / t.paged);
  }
  return 0;
}
