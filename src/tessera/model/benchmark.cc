// Benchmarks over the model forward/backward.
#include "tessera/model/benchmark.h"
#include "tessera/model/quantize.h"

#include <algorithm>
#include <random>
#include <vector>

#include "tessera/base/memory.h"
#include "tessera/base/timer.h"
#include "tessera/base/trace.h"
#include "tessera/kernels/activation.h"
#include "tessera/kernels/matmul.h"
#include "tessera/kernels/packed_b.h"
#include "tessera/kernels/peak.h"
#include "tessera/model/moe.h"

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
  quantize_on_load(m, LoadQuantization(o.weights, o.quantize_lm_head));
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

namespace {

// A triad probe and its trials between windows of decode tokens: each window's GB/s over
// the mean of the trials just before and just after it.
struct PairedTriad {
  explicit PairedTriad(bool huge_pages) : probe(0, huge_pages) {}
  void trial() { trials.push_back(probe.triad_gbps()); }
  // After the trial that closes the window.
  void pair(double window_gbps) {
    ratios.push_back(window_gbps / ((trials[trials.size() - 2] + trials.back()) / 2));
  }
  kernels::StreamProbe probe;
  std::vector<double> trials, ratios;
};

}  // namespace

DecodeBench bench_decode(const Model& model, const BenchOptions& o) {
  const auto& c = model.config();
  DecodeBench r;
  r.weight_bytes = static_cast<double>(model.matmul_weight_bytes());
  const int64_t prompt = 32;
  // A triad trial before the first token and after every kPairWindow tokens: each window's
  // bandwidth against the mean of the trials on its two sides, taken within ~0.2 s of it.
  constexpr int64_t kPairWindow = 8;
  r.huge_page_bytes = base::anon_huge_page_bytes();
  // Two triads: STREAM's (plain pages) and one on the huge pages the weights ask for.
  PairedTriad plain(false), huge(true);
  const auto trials = [&] {
    const base::TraceScope span("stream_triad_trial", "bench");
    plain.trial(), huge.trial();
  };
  std::vector<double> rates, token_seconds;
  for (int rep = 0; rep < o.repeats; ++rep) {
    KVCache cache = KVCache::create(c, prompt + o.decode_tokens + 1);
    Tensor logits = model.forward(random_tokens(prompt, c.vocab_size, rep + 1), cache);
    if (rep == 0 && !o.trace.empty()) base::start_trace(o.trace);
    trials();
    double run_s = 0, window_s = 0;
    int64_t window_n = 0;
    int32_t tok = 1;
    for (int64_t i = 0; i < o.decode_tokens; ++i) {
      double s = 0;
      {
        const base::TraceScope span("decode_token", "bench");
        base::Timer one;
        logits = model.forward({tok}, cache);
        s = one.seconds();
      }
      token_seconds.push_back(s);
      run_s += s, window_s += s, ++window_n;
      tok = static_cast<int32_t>(i % c.vocab_size);
      if (window_n == kPairWindow || i + 1 == o.decode_tokens) {
        trials();
        const double gbps = r.weight_bytes * window_n / window_s / 1e9;
        plain.pair(gbps), huge.pair(gbps);
        window_s = 0, window_n = 0;
      }
    }
    rates.push_back(o.decode_tokens / run_s);
    if (rep == 0 && !o.trace.empty()) base::stop_trace();
  }
  r.tokens_per_second = 1.0 / median(token_seconds);
  r.run_tokens_per_second = median(rates);
  r.achieved_gbps = r.weight_bytes * r.tokens_per_second / 1e9;
  r.paired_ratio = median(plain.ratios);
  r.paired_windows = static_cast<int64_t>(plain.ratios.size());
  r.paired_triad_gbps = median(plain.trials);
  r.paired_huge_ratio = median(huge.ratios);
  r.paired_huge_triad_gbps = median(huge.trials);
  r.stream_triad_gbps = plain.probe.best_triad_gbps(10);  // (measure_stream_triad_gbps's, on the same arrays)
  r.stream_triad_huge_gbps = huge.probe.best_triad_gbps(10);
  r.ratio = r.achieved_gbps / r.stream_triad_gbps;
  r.run_ratio = r.weight_bytes * r.run_tokens_per_second / 1e9 / r.stream_triad_gbps;
  r.stream_read_gbps = kernels::measure_stream_read_gbps();
  r.read_ratio = r.achieved_gbps / r.stream_read_gbps;
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

MoeBench bench_moe(const MoeBenchOptions& o) {
  TESSERA_CHECK(o.experts >= 1 && o.top_k >= 1 && o.top_k <= o.experts && o.hidden >= 1 && o.ffn >= 1 &&
                    o.tokens >= 1 && o.repeats >= 1,
                "bench moe: experts ", o.experts, ", top-k ", o.top_k, ", hidden ", o.hidden, ", ffn ", o.ffn,
                ", tokens ", o.tokens, ", repeats ", o.repeats, " (each must be positive, top-k <= experts)");
  const int64_t E = o.experts, k = o.top_k, H = o.hidden, F = o.ffn, N = o.tokens;
  std::mt19937 rng(7);
  auto randn = [&](const Shape& shape, float sd) {
    std::normal_distribution<float> nd(0.f, sd);
    Tensor t = Tensor::empty(shape, DType::kF32);
    for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = nd(rng);
    return t;
  };
  MoeSpec spec;
  spec.num_experts = E;
  spec.top_k = k;
  MoeWeights w, g;
  w.router = randn({E, H}, 1.f).to(o.dtype);
  w.gate_up = randn({E, 2 * F, H}, 0.02f).to(o.dtype);
  w.down = randn({E, H, F}, 0.02f).to(o.dtype);
  g.router = Tensor::zeros({E, H}, DType::kF32);
  g.gate_up = Tensor::zeros({E, 2 * F, H}, DType::kF32);
  g.down = Tensor::zeros({E, H, F}, DType::kF32);
  Tensor h = randn({N, H}, 1.f);
  const Tensor dout = randn({N, H}, 1.f);
  Tensor out = Tensor::empty({N, H}, DType::kF32), dh = Tensor::empty({N, H}, DType::kF32);
  // The dense peer: one MLP of k F features, the same FLOPs as the k experts per token.
  const Tensor dgu = randn({2 * k * F, H}, 0.02f).to(o.dtype), ddown = randn({H, k * F}, 0.02f).to(o.dtype);
  Tensor u = Tensor::empty({N, 2 * k * F}, DType::kF32), a = Tensor::empty({N, k * F}, DType::kF32);
  Tensor da = a.clone(), du = u.clone(), gdgu = Tensor::zeros({2 * k * F, H}, DType::kF32),
         gdd = Tensor::zeros({H, k * F}, DType::kF32);
  // Packed weights (o.packed): each expert's and the dense peer's, as a model keeping them
  // packed holds them between updates.
  kernels::PackedB dgu_fwd, dgu_dx, ddown_fwd, ddown_dx;
  if (o.packed) {
    pack_expert_weights(w, true);
    kernels::pack_b(dgu, true, dgu_fwd), kernels::pack_b(dgu, false, dgu_dx);
    kernels::pack_b(ddown, true, ddown_fwd), kernels::pack_b(ddown, false, ddown_dx);
  }
  const auto product = [&](const Tensor& x, const Tensor& wt, const kernels::PackedB& p, Tensor& c, bool trans) {
    if (kernels::takes_packed(p, x.size(0))) return kernels::matmul_packed(x, p, c);
    kernels::matmul(x, wt, c, false, trans);
  };
  const auto dense_forward = [&] {
    product(h, dgu, dgu_fwd, u, true);
    kernels::swiglu_forward(u.slice(1, 0, k * F), u.slice(1, k * F, 2 * k * F), a);
    product(a, ddown, ddown_fwd, out, true);
  };
  const auto dense_backward = [&] {
    product(dout, ddown, ddown_dx, da, false);
    kernels::matmul(dout, a, gdd, true, false, 1.f, 1.f);
    Tensor dg = du.slice(1, 0, k * F), dup = du.slice(1, k * F, 2 * k * F);
    kernels::swiglu_backward(da, u.slice(1, 0, k * F), u.slice(1, k * F, 2 * k * F), dg, dup);
    kernels::matmul(du, h, gdgu, true, false, 1.f, 1.f);
    product(du, dgu, dgu_dx, dh, false);
  };
  MoeSaved saved;
  std::vector<double> mf, mb, df, db;
  for (int rep = 0; rep <= o.repeats; ++rep) {  // the first is a warm-up
    // Fresh tokens every repeat, so the router gives each expert another row count, as
    // every training step and serving batch does (a fixed input would time shapes whose
    // GEMM primitives are already cached).
    if (rep > 0) h = randn({N, H}, 1.f);
    if (rep == 1 && !o.trace.empty()) base::start_trace(o.trace);  // the timed repeats only
    const auto timed = [](const char* name, const auto& fn) {
      const base::TraceScope span(name, "bench");
      base::Timer t;
      fn();
      return t.seconds();
    };
    const double f = timed("moe_forward_pass", [&] { moe_forward(spec, w, h, out, &saved); });
    const double b = timed("moe_backward_pass", [&] { moe_backward(spec, w, h, saved, dout, dh, g); });
    const double f2 = timed("dense_forward_pass", dense_forward);
    const double b2 = timed("dense_backward_pass", dense_backward);
    if (rep == 0) continue;
    mf.push_back(f), mb.push_back(b), df.push_back(f2), db.push_back(b2);
  }
  if (!o.trace.empty()) base::stop_trace();
  MoeBench r;
  r.moe_forward_s = median(mf), r.moe_backward_s = median(mb);
  r.dense_forward_s = median(df), r.dense_backward_s = median(db);
  r.expert_gflop = 6.0 * static_cast<double>(N * k) * static_cast<double>(F * H) / 1e9;
  r.forward_ratio = r.dense_forward_s / r.moe_forward_s;
  r.backward_ratio = r.dense_backward_s / r.moe_backward_s;
  int64_t most = 0;
  for (int64_t e = 0; e < E; ++e) most = std::max(most, saved.routing.load(e));
  r.max_over_mean_load = static_cast<double>(most) / (static_cast<double>(N * k) / static_cast<double>(E));
  return r;
}

}  // namespace tessera::model
