// Benchmarks over the model forward/backward.
#include "tessera/model/benchmark.h"
#include "tessera/model/quantize.h"

#include <algorithm>
#include <vector>

#include "tessera/base/timer.h"
#include "tessera/kernels/matmul.h"
#include "tessera/kernels/peak.h"

namespace tessera::model {
namespace {

using base::median;

std::vector<int32_t> random_tokens(int64_t n, int64_t vocab, uint64_t seed) {
  std::vector<int32_t> t(n);
  for (int64_t i = 0; i < n; ++i) {
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    t[i] = static_cast<int32_t>((seed >> 33) % vocab);
  }
  return t;
}

}  // namespace

Model bench_model(const BenchOptions& o) {
  Model m = !o.model_dir.empty() ? Model::load(o.model_dir, o.dtype)
                                 : Model::random(ModelConfig::named_shape(o.shape), o.dtype, 1234);
  quantize_on_load(m, o.weights);
  return m;
}

double forward_flops(const ModelConfig& c, int64_t tokens, int64_t ctx_start) {
  double f = 2.0 * static_cast<double>(c.matmul_weight_elements()) * tokens;
  // Attention: QK^T and PV, 2 * 2 * D flops per (query, visible key) pair per head.
  double pairs = 0;
  for (int64_t i = 0; i < tokens; ++i) pairs += static_cast<double>(ctx_start + i + 1);
  f += 4.0 * c.head_dim * c.num_heads * pairs * c.num_layers;
  return f;
}

DecodeBench bench_decode(const Model& model, const BenchOptions& o) {
  const auto& c = model.config();
  DecodeBench r;
  const int64_t prompt = 32;
  std::vector<double> rates;
  for (int rep = 0; rep < o.repeats; ++rep) {
    KVCache cache = KVCache::create(c, prompt + o.decode_tokens + 1);
    Tensor logits = model.forward(random_tokens(prompt, c.vocab_size, rep + 1), cache);
    base::Timer t;
    int32_t tok = 1;
    for (int64_t i = 0; i < o.decode_tokens; ++i) {
      logits = model.forward({tok}, cache);
      tok = static_cast<int32_t>(i % c.vocab_size);
    }
    rates.push_back(o.decode_tokens / t.seconds());
  }
  r.tokens_per_second = median(rates);
  r.weight_bytes = static_cast<double>(model.matmul_weight_bytes());
  r.achieved_gbps = r.weight_bytes * r.tokens_per_second / 1e9;
  r.stream_triad_gbps = kernels::measure_stream_triad_gbps();
  r.ratio = r.achieved_gbps / r.stream_triad_gbps;
  return r;
}

PrefillBench bench_prefill(const Model& model, const BenchOptions& o) {
  const auto& c = model.config();
  PrefillBench r;
  const auto prompt = random_tokens(o.prompt_tokens, c.vocab_size, 7);
  KVCache cache = KVCache::create(c, o.prompt_tokens);
  std::vector<double> secs;
  for (int rep = 0; rep < o.repeats + 1; ++rep) {
    cache.reset();
    base::Timer t;
    model.forward(prompt, cache);
    if (rep > 0) secs.push_back(t.seconds());  // first run warms caches and primitives
  }
  const double s = median(secs);
  r.tokens_per_second = o.prompt_tokens / s;
  r.gflops = forward_flops(c, o.prompt_tokens, 0) / s / 1e9;
  r.peak_dtype = matmul_peak_dtype(model.bf16_mode());
  r.peak_gflops = kernels::measure_gemm_peak(r.peak_dtype).gflops;
  r.ratio = r.gflops / r.peak_gflops;
  return r;
}

}  // namespace tessera::model
