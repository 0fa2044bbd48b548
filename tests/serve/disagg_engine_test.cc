// The engine side of prefill/decode disaggregation, in one process: a prompt's KV blocks
// exported from one engine (hold_kv_prefix), imported into another (reserve / commit), and the
// request resumed there from its first token (add_resumed_request). Greedy output is checked
// against dense greedy decoding through Model::forward (an independent path), seeded sampling
// against one engine running the whole request; block counts and chain-hash checks exactly.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "tessera/base/error.h"
#include "tessera/infer/engine.h"
#include "tessera/model/model.h"

namespace tessera::infer {
namespace {

model::Model make_model() {
  model::ModelConfig c = model::ModelConfig::named_shape("tiny");
  c.max_position_embeddings = 512;
  model::Model m = model::Model::random(c, DType::kF32, 21);
  // Widened logits: greedy choices are clear-cut, so rounding between paths cannot flip them.
  Tensor& head = m.weights().lm_head;
  for (int64_t i = 0; i < head.numel(); ++i) head.data<float>()[i] *= 8.f;
  m.weights().tie(c);
  return m;
}

EngineConfig engine_config() {
  EngineConfig e;
  e.block_size = 16;
  e.kv_cache_memory = 4 << 20;
  e.max_model_len = 256;
  e.batch_invariant = true;
  return e;
}

std::vector<int32_t> prompt_of(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = static_cast<int32_t>(3 + rng() % 250);
  return t;
}

std::vector<int32_t> dense_greedy(const model::Model& m, const std::vector<int32_t>& prompt, int64_t n) {
  model::KVCache cache = model::KVCache::create(m.config(), 256);
  std::vector<int32_t> out;
  Tensor logits = m.forward(prompt, cache);
  for (int64_t i = 0; i < n; ++i) {
    const float* x = logits.data<float>() + (logits.numel() - m.config().vocab_size);
    const int32_t t = static_cast<int32_t>(std::max_element(x, x + m.config().vocab_size) - x);
    out.push_back(t);
    logits = m.forward({t}, cache);
  }
  return out;
}

// Runs the engine until idle; the tokens of request `id` and its last output.
std::vector<int32_t> run(Engine& e, RequestId id, RequestOutput* last = nullptr) {
  std::vector<int32_t> toks;
  while (e.has_unfinished())
    for (auto& o : e.step())
      if (o.id == id) {
        toks.insert(toks.end(), o.new_tokens.begin(), o.new_tokens.end());
        if (last) *last = o;
      }
  return toks;
}

// Prefill on `a` (max_tokens 1), blocks moved to `b`, the request resumed on `b`.
std::vector<int32_t> disaggregated(Engine& a, Engine& b, const std::vector<int32_t>& prompt, SamplingParams p,
                                   RequestOutput* last) {
  SamplingParams first_only = p;
  first_only.max_tokens = 1;
  const std::vector<int32_t> first = run(a, a.add_request(prompt, first_only));
  EXPECT_EQ(first.size(), 1u);
  const int64_t n = static_cast<int64_t>(prompt.size()) / 16;
  Engine::KvChain out = a.hold_kv_prefix(prompt, -1);
  EXPECT_EQ(out.have, n);
  EXPECT_EQ(static_cast<int64_t>(out.blocks.size()), n);
  auto in = b.reserve_kv_import(prompt, -1, out.hashes);
  EXPECT_TRUE(in.has_value());
  std::vector<uint8_t> bytes(static_cast<size_t>(a.kv_pool().block_bytes()));
  for (int64_t i = in->have; i < n; ++i) {
    a.kv_pool().read_block(out.blocks[i], bytes.data());
    b.kv_pool().write_block(in->blocks[i], bytes.data());
  }
  b.commit_kv_import(*in, prompt);
  a.release_kv(out.holder);
  RequestOutput primed;
  const RequestId id = b.add_resumed_request(prompt, first, p, -1, &primed);
  EXPECT_EQ(primed.new_tokens, first);
  std::vector<int32_t> rest = run(b, id, last);
  b.release_kv(in->holder);
  rest.insert(rest.begin(), first.begin(), first.end());
  return rest;
}

TEST(DisaggEngine, ImportedBlocksAndResumedRequestGiveDenseGreedyOutput) {
  const model::Model m = make_model();
  Engine a(m, engine_config()), b(m, engine_config());
  for (int64_t n : {5, 16, 37, 64, 100}) {
    SCOPED_TRACE(n);
    const auto prompt = prompt_of(n, static_cast<uint32_t>(n));
    SamplingParams p;
    p.max_tokens = 12;
    p.ignore_eos = true;
    RequestOutput last;
    EXPECT_EQ(disaggregated(a, b, prompt, p, &last), dense_greedy(m, prompt, 12));
    EXPECT_EQ(last.num_cached_tokens, n / 16 * 16);  // the whole imported chain was a hit
    EXPECT_EQ(last.num_output_tokens, 12);
    EXPECT_EQ(last.finish_reason, "length");
  }
  EXPECT_EQ(a.stats().kv_blocks_used, 0);  // every hold released, every request finished
  EXPECT_EQ(b.stats().kv_blocks_used, 0);
  EXPECT_EQ(b.stats().generation_tokens, 5 * 11);  // the first tokens are the prefill engine's
}

TEST(DisaggEngine, SeededSamplingContinuesTheSameStream) {
  const model::Model m = make_model();
  Engine a(m, engine_config()), b(m, engine_config()), whole(m, engine_config());
  SamplingParams p;
  p.temperature = 1.5f;
  p.top_p = 0.95f;
  p.seed = 77;
  p.max_tokens = 20;
  p.ignore_eos = true;
  p.presence_penalty = 0.5f;  // counts the first token, which the decode engine did not sample
  const auto prompt = prompt_of(40, 3);
  RequestOutput last;
  const auto split = disaggregated(a, b, prompt, p, &last);
  EXPECT_EQ(split, run(whole, whole.add_request(prompt, p)));
  EXPECT_EQ(split.size(), 20u);
}

TEST(DisaggEngine, ImportChecksTheChainAndSkipsCachedBlocks) {
  const model::Model m = make_model();
  Engine a(m, engine_config()), b(m, engine_config());
  const auto prompt = prompt_of(50, 9);
  SamplingParams p;
  p.max_tokens = 1;
  run(a, a.add_request(prompt, p));
  Engine::KvChain out = a.hold_kv_prefix(prompt, -1);
  ASSERT_EQ(out.blocks.size(), 3u);
  // Hashes of other tokens (or another adapter's chain) are refused before anything is taken.
  auto wrong = out.hashes;
  wrong[1] ^= 1;
  EXPECT_THROW(b.reserve_kv_import(prompt, -1, wrong), Error);
  auto other = prompt;
  other[20] += 1;
  EXPECT_THROW(b.reserve_kv_import(other, -1, out.hashes), Error);
  EXPECT_EQ(b.stats().kv_blocks_used, 0);
  auto in = b.reserve_kv_import(prompt, -1, out.hashes);
  ASSERT_TRUE(in);
  EXPECT_EQ(in->have, 0);
  EXPECT_EQ(b.stats().kv_blocks_used, 3);
  b.commit_kv_import(*in, prompt);
  b.release_kv(in->holder);
  // Again: the blocks are cached on b now, nothing is reserved anew.
  auto again = b.reserve_kv_import(prompt, -1, out.hashes);
  ASSERT_TRUE(again);
  EXPECT_EQ(again->have, 3);
  EXPECT_EQ(again->blocks, in->blocks);
  b.release_kv(again->holder);
  a.release_kv(out.holder);
  // A resumed request must leave something to generate and may not have n > 1.
  p.max_tokens = 1;
  EXPECT_THROW(b.add_resumed_request(prompt, {7}, p), FieldError);
  p.max_tokens = 4;
  p.n = 2;
  p.temperature = 1;
  EXPECT_THROW(b.add_resumed_request(prompt, {7}, p), FieldError);
}

}  // namespace
}  // namespace tessera::infer
