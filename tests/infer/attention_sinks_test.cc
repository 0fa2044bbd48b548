// StreamingLLM attention sinks in the engine (--attention-sinks S --window W), against
// independent references:
//  - a one-layer model, whose keys and values depend only on each token and its position:
//    after the window has slid several times, the next token's log-probabilities equal a
//    plain dense Model::forward over [the first S tokens] + [the window's tokens] at
//    positions 0 .. S + W' - 1 (the multi-layer cache differs from such a recomputation:
//    each token's K/V were computed against the window of its own time);
//  - multi-layer models: a token-by-token emulation on Model::forward's dense KV cache
//    that evicts the same rows and moves the kept keys by un-rotating them at their old
//    position and rotating them at the new one with kernels::rope_apply (not the engine's
//    composed rotation); the engine's greedy stream gives its tokens and log-probabilities;
//  - constant memory (blocks held never above ceil((S + W) / block)), a stream 10x the
//    window; chunking, forked samples, bf16 / int8 / fp8 caches, and one-line errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <random>

#include "tessera/infer/engine.h"
#include "tessera/infer/stream_eval.h"
#include "tessera/kernels/rope.h"
#include "test_util/throws.h"

namespace tessera::infer {
namespace {

using testing::throws_error;

model::Model make_model(int64_t layers, uint64_t seed, const std::string& type = "llama") {
  model::ModelConfig c = model::ModelConfig::named_shape("tiny");
  c.num_layers = layers;
  c.max_position_embeddings = 128;
  if (type == "qwen2") {  // biases on q, k, v; another theta; half of each head rotated (as GPT-NeoX)
    c.model_type = "qwen2";
    c.arch = model::Arch::kQwen2;
    c.rope_theta = 1e6f;
    c.partial_rotary_factor = 0.5;
  }
  model::Model m = model::Model::random(c, DType::kF32, seed);
  auto& w = m.weights();
  Tensor& head = c.tie_word_embeddings ? w.embed : w.lm_head;
  for (int64_t i = 0; i < head.numel(); ++i) head.data<float>()[i] *= 8.f;  // clear-cut greedy choices
  w.tie(c);
  return m;
}

std::vector<int32_t> random_tokens(int64_t n, uint64_t seed) {
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = static_cast<int32_t>(3 + rng() % 250);
  return t;
}

std::vector<double> log_softmax(const float* x, int64_t V) {
  const float mx = *std::max_element(x, x + V);
  double s = 0;
  for (int64_t i = 0; i < V; ++i) s += std::exp(static_cast<double>(x[i] - mx));
  std::vector<double> out(static_cast<size_t>(V));
  for (int64_t i = 0; i < V; ++i) out[static_cast<size_t>(i)] = x[i] - mx - std::log(s);
  return out;
}

// StreamingLLM on Model::forward's dense cache, one token at a time: when the cache holds
// S + W rows, the window's oldest `bs` rows go and the rest move down, each kept key
// un-rotated at its old position and rotated at its new one by kernels::rope_apply.
struct DenseStream {
  const model::Model& m;
  int64_t S, W, bs;
  model::KVCache cache;
  DenseStream(const model::Model& model, int64_t s, int64_t w, int64_t b)
      : m(model), S(s), W(w), bs(b), cache(model::KVCache::create(model.config(), s + w)) {}

  std::vector<double> feed(int32_t token) {
    if (cache.length == S + W) evict();
    const Tensor logits = m.forward({token}, cache);
    return log_softmax(logits.data<float>(), logits.numel());
  }

  void evict() {
    const auto& c = m.config();
    const int64_t D = c.head_dim, KV = c.num_kv_heads * D, n = S + W - bs - S;
    const auto rotary = static_cast<int64_t>(static_cast<double>(D) * c.partial_rotary_factor);
    const kernels::RopeFreqs f = kernels::rope_default_freqs(rotary, c.rope_theta);
    Tensor old_pos = Tensor::empty({n}, DType::kI32), new_pos = Tensor::empty({n}, DType::kI32);
    for (int64_t i = 0; i < n; ++i) {
      old_pos.data<int32_t>()[i] = static_cast<int32_t>(S + bs + i);
      new_pos.data<int32_t>()[i] = static_cast<int32_t>(S + i);
    }
    for (int64_t l = 0; l < c.num_layers; ++l) {
      Tensor k = cache.k[l].view({cache.capacity, KV}).slice(0, S + bs, S + W).clone();
      kernels::rope_apply(k, D, old_pos, f, /*inverse=*/true);
      kernels::rope_apply(k, D, new_pos, f);
      cache.k[l].view({cache.capacity, KV}).slice(0, S, S + n).copy_from(k);
      const Tensor v = cache.v[l].view({cache.capacity, KV}).slice(0, S + bs, S + W).clone();
      cache.v[l].view({cache.capacity, KV}).slice(0, S, S + n).copy_from(v);
    }
    cache.length = S + n;
  }
};

EngineConfig stream_config(int64_t S, int64_t W, kernels::KvCacheDtype dtype = kernels::KvCacheDtype::kF32) {
  EngineConfig e;
  e.block_size = 16;
  e.kv_cache_dtype = dtype;
  e.kv_cache_memory = 4 << 20;
  e.max_num_batched_tokens = 64;
  e.attention_sinks = S;
  e.stream_window = W;
  return e;
}

// Runs one request to the end; returns its tokens and per-token log-probabilities.
std::vector<RequestOutput> run_all(Engine& engine, std::function<void()> each_step = nullptr) {
  std::vector<RequestOutput> all;
  while (engine.has_unfinished()) {
    for (auto& o : engine.step()) all.push_back(std::move(o));
    if (each_step) each_step();
  }
  return all;
}

TEST(AttentionSinks, OneLayerNextTokenEqualsDenseForwardOverSinksAndWindow) {
  const model::Model m = make_model(1, 11);
  const int64_t S = 4, W = 60, bs = 16, V = m.config().vocab_size;
  for (int64_t P : {64, 65, 200, 333}) {  // full but not shifted; one row past full; several shifts
    const std::vector<int32_t> prompt = random_tokens(P, 100 + P);
    Engine engine(m, stream_config(S, W));
    SamplingParams sp;
    sp.max_tokens = 1;
    sp.logprobs = 20;
    engine.add_request(prompt, sp);
    const auto outs = run_all(engine);
    ASSERT_EQ(outs.size(), 1u);
    ASSERT_EQ(outs[0].logprobs.size(), 1u);
    // The cache fills to S + W, then drops 16 at a time before the token that would overflow
    // it: after P tokens it holds the sinks and the last W' of them.
    const int64_t dropped = P <= S + W ? 0 : bs * ((P - (S + W) + bs - 1) / bs);
    std::vector<int32_t> kept(prompt.begin(), prompt.begin() + S);
    kept.insert(kept.end(), prompt.begin() + S + dropped, prompt.end());
    ASSERT_LE(static_cast<int64_t>(kept.size()), S + W);
    ASSERT_GE(static_cast<int64_t>(kept.size()), S + W - bs + 1) << P;
    model::KVCache cache = model::KVCache::create(m.config(), S + W);
    const Tensor logits = m.forward(kept, cache);
    const auto ref = log_softmax(logits.data<float>(), V);
    for (const TokenLogprob& t : outs[0].logprobs[0].top_logprobs)
      EXPECT_NEAR(t.logprob, ref[static_cast<size_t>(t.token)], 2e-5) << "P " << P << " token " << t.token;
    EXPECT_EQ(outs[0].new_tokens[0], std::max_element(ref.begin(), ref.end()) - ref.begin());
  }
}

TEST(AttentionSinks, LongGreedyStreamMatchesDenseEmulationInConstantMemory) {
  for (const std::string type : {"llama", "qwen2"}) {
    const model::Model m = make_model(2, 21, type);
    const int64_t S = 4, W = 44, bs = 16;  // a cache of 48 rows = 3 blocks; 500 tokens = 10x it
    const std::vector<int32_t> prompt = random_tokens(150, 5);
    Engine engine(m, stream_config(S, W));
    SamplingParams sp;
    sp.max_tokens = 350;
    sp.ignore_eos = true;
    sp.logprobs = 5;
    engine.add_request(prompt, sp);
    int64_t most = 0;
    const auto outs = run_all(engine, [&] {
      most = std::max({most, engine.kv_usage().blocks, engine.stats().kv_blocks_used});
    });
    std::vector<int32_t> gen;
    std::vector<SampleResult> lps;
    for (const auto& o : outs) {
      gen.insert(gen.end(), o.new_tokens.begin(), o.new_tokens.end());
      lps.insert(lps.end(), o.logprobs.begin(), o.logprobs.end());
    }
    ASSERT_EQ(gen.size(), 350u) << type;  // the stream ran past max_model_len 128: only max_tokens ends it
    EXPECT_EQ(most, (S + W + bs - 1) / bs) << type;
    EXPECT_EQ(engine.stats().kv_blocks_used, 0);

    DenseStream ref(m, S, W, bs);
    std::vector<double> lp;
    for (int32_t t : prompt) lp = ref.feed(t);
    double worst = 0;
    for (size_t i = 0; i < gen.size(); ++i) {
      const int64_t want = std::max_element(lp.begin(), lp.end()) - lp.begin();
      ASSERT_EQ(gen[i], want) << type << " token " << i;
      for (const TokenLogprob& t : lps[i].top_logprobs)
        worst = std::max(worst, std::fabs(t.logprob - lp[static_cast<size_t>(t.token)]));
      lp = ref.feed(gen[i]);
    }
    EXPECT_LT(worst, 1e-4) << type;
    std::printf("%s: 500-token stream, max |logprob - dense emulation's| %.2e, at most %lld blocks\n",
                type.c_str(), worst, (long long)most);
  }
}

TEST(AttentionSinks, ScoresDoNotDependOnChunkingAndStayCloseInEveryCacheDtype) {
  const model::Model m = make_model(2, 31);
  const std::vector<int32_t> tokens = random_tokens(400, 9);
  StreamEvalOptions o;
  o.attention_sinks = 4;
  o.window = 60;
  o.chunk = 1;
  const auto one = evaluate_stream(m, tokens, o);
  EXPECT_EQ(one.max_blocks, 4);
  EXPECT_EQ(one.shifts, (400 - 64 + 15) / 16);
  for (int64_t chunk : {7, 16, 64}) {
    o.chunk = chunk;
    const auto r = evaluate_stream(m, tokens, o);
    ASSERT_EQ(r.nll.size(), one.nll.size());
    for (size_t i = 0; i < r.nll.size(); ++i) ASSERT_NEAR(r.nll[i], one.nll[i], 2e-5) << "chunk " << chunk << " " << i;
    EXPECT_EQ(r.shifts, one.shifts);
  }
  // Lower-precision caches re-quantize each moved key: the error grows with the moves a key
  // has made (at most W / 16 = 3 here) but stays in the order of the form's rounding.
  o.chunk = 16;
  const std::pair<kernels::KvCacheDtype, double> forms[] = {
      {kernels::KvCacheDtype::kBF16, 0.02}, {kernels::KvCacheDtype::kInt8, 0.05}, {kernels::KvCacheDtype::kFp8, 0.2}};
  for (const auto& [dtype, tol] : forms) {
    o.kv_cache_dtype = dtype;
    const auto r = evaluate_stream(m, tokens, o);
    double worst = 0;
    for (size_t i = 0; i < r.nll.size(); ++i) worst = std::max(worst, std::fabs(r.nll[i] - one.nll[i]));
    std::printf("kv %s: max |nll - f32 cache's| %.4f over 399 predictions\n", kernels::kv_cache_dtype_name(dtype),
                worst);
    EXPECT_LT(worst, tol) << kernels::kv_cache_dtype_name(dtype);
  }
}

TEST(AttentionSinks, ForkedSamplesCopyTheBlocksTheyShift) {
  const model::Model m = make_model(2, 41);
  const std::vector<int32_t> prompt = random_tokens(40, 3);
  SamplingParams sp;
  sp.max_tokens = 120;  // 160 tokens through a 52-row cache: every sample shifts shared blocks
  sp.temperature = 1.f;
  sp.ignore_eos = true;
  auto run = [&](int64_t n, uint64_t seed) {
    Engine engine(m, stream_config(4, 48));
    SamplingParams p = sp;
    p.n = n;
    p.seed = seed;
    engine.add_request(prompt, p);
    std::map<int64_t, std::vector<int32_t>> by_index;
    for (const auto& o : run_all(engine)) {
      auto& v = by_index[o.index];
      v.insert(v.end(), o.new_tokens.begin(), o.new_tokens.end());
    }
    return by_index;
  };
  const auto both = run(2, 7);
  const auto first = run(1, 7), second = run(1, 8);  // sample i of n draws with seed + i
  ASSERT_EQ(both.size(), 2u);
  EXPECT_EQ(both.at(0), first.at(0));
  EXPECT_EQ(both.at(1), second.at(0));
}

TEST(AttentionSinks, OneLineErrors) {
  const model::Model m = make_model(2, 51);
  auto make = [&](const model::Model& mm, EngineConfig e) { Engine engine(mm, e); };
  EngineConfig e = stream_config(4, 64);
  e.stream_window = 0;
  EXPECT_TRUE(throws_error([&] { make(m, e); }, {"--attention-sinks needs --window"}, true));
  e = stream_config(-1, 64);
  EXPECT_TRUE(throws_error([&] { make(m, e); }, {"--window needs --attention-sinks"}, true));
  e = stream_config(-3, 64);
  EXPECT_TRUE(throws_error([&] { make(m, e); }, {"--attention-sinks must be >= 0"}, true));
  e = stream_config(4, 8);
  EXPECT_TRUE(throws_error([&] { make(m, e); }, {"--window must be at least --block-size"}, true));
  e = stream_config(4, 126);
  EXPECT_TRUE(throws_error([&] { make(m, e); }, {"130 exceeds the context length 128"}, true));
  e = stream_config(4, 64);
  e.speculative_method = "ngram";
  e.num_speculative_tokens = 2;
  EXPECT_TRUE(throws_error([&] { make(m, e); }, {"does not combine with --speculative"}, true));

  model::ModelConfig g = model::ModelConfig::named_shape("tiny");
  g.arch = model::Arch::kGpt2;
  g.model_type = "gpt2";
  g.max_position_embeddings = 128;
  EXPECT_TRUE(throws_error([&] { make(model::Model::random(g, DType::kF32, 1), stream_config(4, 64)); },
                           {"--attention-sinks: gpt2 has learned absolute positions"}, true));
  model::ModelConfig w = model::ModelConfig::named_shape("tiny");
  w.model_type = "mistral";
  w.sliding_window = 32;
  EXPECT_TRUE(throws_error([&] { make(model::Model::random(w, DType::kF32, 1), stream_config(4, 64)); },
                           {"already attends to a sliding window of 32"}, true));

  // Without sinks a prompt must fit the context; with them it streams.
  SamplingParams sp;
  sp.max_tokens = 2;
  Engine plain(m, [] { EngineConfig c; c.kv_cache_memory = 4 << 20; return c; }());
  EXPECT_TRUE(throws_error([&] { plain.add_request(random_tokens(200, 1), sp); }, {"context length is 128"}));
  Engine streaming(m, stream_config(4, 64));
  EXPECT_NE(streaming.kv_cache_summary().find("attention sinks 4 + window 64: 5 blocks per stream, prefix caching off"),
            std::string::npos)
      << streaming.kv_cache_summary();
  EXPECT_FALSE(streaming.config().prefix_caching);
  streaming.add_request(random_tokens(200, 1), sp);
  const auto outs = run_all(streaming);
  EXPECT_EQ(outs.back().finish_reason, "length");
  EXPECT_EQ(outs.back().num_output_tokens, 2);
}

}  // namespace
}  // namespace tessera::infer
