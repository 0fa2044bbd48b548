// Multi-LoRA serving in the engine: requests for three adapters and the base model, submitted
// together (one batch per step, chunked prefill, shared prompts), each give the greedy output
// of that request run alone in its own engine over a model with its adapter merged into the
// weights (model::merge_lora: an independent path); the prefix cache never hands one
// adapter's blocks to another; bad adapter indices are refused.
#include <gtest/gtest.h>

#include <map>
#include <random>

#include "test_util/lora_adapters.h"
#include "tessera/base/thread_pool.h"
#include "tessera/infer/engine.h"
#include "tessera/model/lora.h"
#include "tessera/model/lora_io.h"

namespace tessera::infer {
namespace {

using model::LoraConfig;
using model::LoraModule;
using model::LoraWeights;

// The tiny llama with a widened head: greedy choices clear of float reassociation.
model::Model make_model() {
  model::ModelConfig c = model::ModelConfig::named_shape("tiny");
  c.max_position_embeddings = 512;
  model::Model m = model::Model::random(c, DType::kF32, 21);
  auto& w = m.weights();
  for (int64_t i = 0; i < w.lm_head.numel(); ++i) w.lm_head.data<float>()[i] *= 8.f;
  w.tie(c);
  return m;
}

std::vector<LoraWeights> adapters_for(const model::ModelConfig& c) {
  LoraConfig a, b, d;
  a.rank = 4, a.alpha = 8;
  a.targets = {LoraModule::kQ, LoraModule::kK, LoraModule::kV, LoraModule::kO,
               LoraModule::kGate, LoraModule::kUp, LoraModule::kDown};
  b.rank = 8, b.alpha = 8;
  b.targets = {LoraModule::kQ, LoraModule::kV, LoraModule::kDown};
  d.rank = 2, d.alpha = 4;
  d.targets = {LoraModule::kK, LoraModule::kO, LoraModule::kUp};
  return {testing::trained_lora(c, a, 1, 0.3f), testing::trained_lora(c, b, 2, 0.3f), testing::trained_lora(c, d, 3, 0.3f)};
}

EngineConfig engine_config() {
  EngineConfig ec;
  ec.block_size = 8;
  ec.max_num_batched_tokens = 32;  // chunked prefill, prompts and decodes mixed
  ec.max_model_len = 256;
  ec.kv_cache_memory = 4 << 20;
  ec.kv_cache_dtype = kernels::KvCacheDtype::kF32;  // as Model::forward's cache: no rounding near-ties
  return ec;
}

SamplingParams greedy(int64_t max_tokens) {
  SamplingParams sp;
  sp.max_tokens = max_tokens;
  sp.ignore_eos = true;
  return sp;
}

struct Outputs {
  std::map<RequestId, std::vector<int32_t>> tokens;
  std::map<RequestId, int64_t> cached;
};

Outputs run_all(Engine& e) {
  Outputs got;
  for (int guard = 0; e.has_unfinished(); ++guard) {
    if (guard >= 100000) {
      ADD_FAILURE() << "engine made no progress";
      break;
    }
    for (const auto& o : e.step()) {
      auto& v = got.tokens[o.id];
      v.insert(v.end(), o.new_tokens.begin(), o.new_tokens.end());
      got.cached[o.id] = o.num_cached_tokens;
    }
  }
  return got;
}

// The request alone, in its own engine, over `m` (the base, or the base with one adapter merged).
std::vector<int32_t> alone(const model::Model& m, const std::vector<int32_t>& prompt, int64_t max_tokens) {
  Engine e(m, engine_config());
  const RequestId id = e.add_request(prompt, greedy(max_tokens));
  return run_all(e).tokens[id];
}

struct OneThread {  // many tiny forwards: parallel regions only cost time on 2 shared cores
  int before = base::num_threads();
  OneThread() { base::set_num_threads(1); }
  ~OneThread() { base::set_num_threads(before); }
};

TEST(MultiLoraEngine, MixedAdaptersEqualEachRequestAloneOnItsMergedModel) {
  OneThread one;
  model::Model m = make_model();
  const std::vector<LoraWeights> adapters = adapters_for(m.config());
  std::vector<model::Model> merged;
  for (const auto& a : adapters) {
    merged.push_back(make_model());
    model::merge_lora(merged.back(), a);
  }
  m.set_lora_bank({&adapters[0], &adapters[1], &adapters[2]});

  std::mt19937 rng(5);
  auto tokens = [&](int64_t n) {
    std::vector<int32_t> t(n);
    for (auto& x : t) x = static_cast<int32_t>(3 + rng() % 250);
    return t;
  };
  // Three requests share a 20-token prompt under different adapters; the rest are apart.
  const std::vector<int32_t> shared = tokens(20);
  struct Req {
    std::vector<int32_t> prompt;
    int32_t adapter;
  };
  std::vector<Req> reqs = {{shared, 0}, {shared, 1}, {shared, -1}};
  const int32_t order[] = {0, 1, 2, -1, 2, 0, 1, -1, 0};
  for (int32_t a : order) reqs.push_back({tokens(2 + rng() % 30), a});
  const int64_t max_tokens = 24;

  Engine e(m, engine_config());
  std::vector<RequestId> ids;
  for (const auto& r : reqs) ids.push_back(e.add_request(r.prompt, greedy(max_tokens), 0, r.adapter));
  const Outputs got = run_all(e);
  for (size_t i = 0; i < reqs.size(); ++i) {
    const int32_t a = reqs[i].adapter;
    const auto want = alone(a < 0 ? m : merged[a], reqs[i].prompt, max_tokens);
    ASSERT_EQ(want.size(), static_cast<size_t>(max_tokens));
    EXPECT_EQ(got.tokens.at(ids[i]), want) << "request " << i << " (adapter " << a << ")";
  }
  // The adapters change the outputs (the comparison could fail): the shared prompt's three
  // continuations are not all equal.
  EXPECT_FALSE(got.tokens.at(ids[0]) == got.tokens.at(ids[1]) && got.tokens.at(ids[1]) == got.tokens.at(ids[2]));
  EXPECT_EQ(e.stats().kv_blocks_used, 0);
}

TEST(MultiLoraEngine, PrefixCacheIsKeptApartPerAdapter) {
  OneThread one;
  model::Model m = make_model();
  const std::vector<LoraWeights> adapters = adapters_for(m.config());
  model::Model merged1 = make_model();
  model::merge_lora(merged1, adapters[1]);
  m.set_lora_bank({&adapters[0], &adapters[1]});
  std::mt19937 rng(9);
  std::vector<int32_t> prompt(30);
  for (auto& x : prompt) x = static_cast<int32_t>(3 + rng() % 250);

  Engine e(m, engine_config());
  const RequestId first = e.add_request(prompt, greedy(4), 0, 0);
  run_all(e);
  (void)first;
  // The same prompt again: adapter 0 finds its 3 full blocks, adapter 1 and the base none.
  const RequestId same = e.add_request(prompt, greedy(8), 0, 0);
  const RequestId other = e.add_request(prompt, greedy(8), 0, 1);
  const RequestId base = e.add_request(prompt, greedy(8), 0, -1);
  const Outputs got = run_all(e);
  EXPECT_EQ(got.cached.at(same), 24);
  EXPECT_EQ(got.cached.at(other), 0);
  EXPECT_EQ(got.cached.at(base), 0);
  EXPECT_EQ(got.tokens.at(other), alone(merged1, prompt, 8));
  // A second base request now hits the base's own blocks.
  const RequestId base2 = e.add_request(prompt, greedy(8), 0, -1);
  const Outputs again = run_all(e);
  EXPECT_EQ(again.cached.at(base2), 24);
  EXPECT_EQ(again.tokens.at(base2), got.tokens.at(base));
}

TEST(MultiLoraEngine, RefusesAnAdapterOutsideTheBank) {
  model::Model m = make_model();
  const std::vector<LoraWeights> adapters = adapters_for(m.config());
  Engine plain(m, engine_config());
  EXPECT_THROW(plain.add_request({5, 6, 7}, greedy(2), 0, 0), Error);  // no bank
  m.set_lora_bank({&adapters[0]});
  Engine e(m, engine_config());
  EXPECT_THROW(e.add_request({5, 6, 7}, greedy(2), 0, 1), Error);
  EXPECT_THROW(e.add_request({5, 6, 7}, greedy(2), 0, -2), Error);
  EXPECT_NO_THROW(e.add_request({5, 6, 7}, greedy(2), 0, 0));
}

}  // namespace
}  // namespace tessera::infer
