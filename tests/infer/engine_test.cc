// The engine end to end on small random models: 64 concurrent requests with shared
// prefixes, chunked prefill and forced preemption give each request's greedy output run
// alone through the dense KV-cache path (infer::generate); seeded sampling reproduces;
// batch-invariant mode gives bit-identical log-probabilities whatever the batch; n > 1
// samples fork; aborts free everything.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <span>

#include "tessera/base/thread_pool.h"
#include "tessera/infer/engine.h"
#include "tessera/infer/generate.h"
#include "tessera/kernels/dispatch.h"
#include "test_util/deepseek_config.h"
#include "test_util/gemma2_config.h"

namespace tessera::infer {
namespace {

// window > 0: Mistral, every layer attending to the last `window` positions.
model::Model make_model(model::Arch arch, uint64_t seed, bool moe = false, bool deepseek = false,
                        int64_t window = 0) {
  model::ModelConfig c = model::ModelConfig::named_shape("tiny");
  c.max_position_embeddings = 512;
  if (window > 0) {
    c.model_type = "mistral";
    c.sliding_window = window;
  }
  if (moe) {  // Mixtral: top-2 of 4 experts in every layer
    c.model_type = "mixtral";
    c.num_experts = 4;
    c.experts_per_token = 2;
    c.moe_intermediate_size = c.intermediate_size;
  }
  if (deepseek) {  // DeepSeek-V3: latent attention, a dense layer 0, then top-2 of 4 experts + 1 shared
    c = testing::tiny_deepseek_v3(c.vocab_size, c.num_layers, 1);
    c.max_position_embeddings = 512;
  }
  if (arch == model::Arch::kGpt2) {
    c.arch = arch;
    c.model_type = "gpt2";
    c.tie_word_embeddings = true;
  }
  model::Model m = model::Model::random(c, DType::kF32, seed);
  // Random weights give nearly flat logits; widen them so greedy choices are clear-cut
  // and float reassociation between the paged and dense paths cannot flip an argmax.
  auto& w = m.weights();
  Tensor& head = c.tie_word_embeddings ? w.embed : w.lm_head;
  const int64_t n = head.numel();
  for (int64_t i = 0; i < n; ++i) head.data<float>()[i] *= 8.f;
  // Random routers score every expert nearly alike, so a batch's rounding could swap a
  // token's second and third expert; scaled, no choice is within rounding of a tie.
  // (Sigmoid scores saturate: DeepSeek's routers are widened less.)
  if (moe)
    for (auto& L : w.layers)
      for (int64_t i = 0; L.moe.router.defined() && i < L.moe.router.numel(); ++i)
        L.moe.router.data<float>()[i] *= deepseek ? 4.f : 30.f;
  w.tie(c);
  return m;
}

std::vector<int32_t> random_tokens(std::mt19937& rng, int64_t n) {
  std::vector<int32_t> t(n);
  for (auto& x : t) x = static_cast<int32_t>(3 + rng() % 250);
  return t;
}

// The reference: greedy decoding of one sequence through Model::forward with its dense
// per-sequence KV cache (the core engine's path, tested against PyTorch).
std::vector<int32_t> dense_greedy(const model::Model& m, const std::vector<int32_t>& prompt,
                                  int64_t max_tokens) {
  model::KVCache cache = model::KVCache::create(m.config(), static_cast<int64_t>(prompt.size()) + max_tokens);
  Tensor logits = m.forward(prompt, cache);
  std::vector<int32_t> out;
  for (int64_t i = 0; i < max_tokens; ++i) {
    const float* x = logits.data<float>();
    const int32_t t = static_cast<int32_t>(std::max_element(x, x + logits.numel()) - x);

    out.push_back(t);
    if (i + 1 < max_tokens) logits = m.forward({t}, cache);
  }
  return out;
}

// Runs every request to completion; returns the outputs by request id.
std::map<RequestId, std::vector<int32_t>> run_all(Engine& e) {
  std::map<RequestId, std::vector<int32_t>> got;
  int guard = 0;
  while (e.has_unfinished()) {
    for (const auto& o : e.step()) {
      auto& v = got[o.id * 1000 + o.index];
      v.insert(v.end(), o.new_tokens.begin(), o.new_tokens.end());
    }
    EXPECT_LT(++guard, 100000) << "engine made no progress";
    if (guard >= 100000) break;
  }
  return got;
}

// Each prompt's output (max_tokens, ignoring EOS; greedy, or seeded sampling at 0.8) under
// `ec`, and the engine's statistics.
std::pair<std::vector<std::vector<int32_t>>, EngineStats> run_prompts(
    const model::Model& m, const EngineConfig& ec, const std::vector<std::vector<int32_t>>& prompts,
    int64_t max_tokens, bool sample) {
  Engine e(m, ec);
  std::vector<RequestId> ids;
  for (const auto& p : prompts) {
    SamplingParams sp;
    sp.max_tokens = max_tokens;
    sp.ignore_eos = true;
    if (sample) {
      sp.temperature = 0.8f;
      sp.seed = 99;
    }
    ids.push_back(e.add_request(p, sp));
  }
  auto got = run_all(e);
  std::vector<std::vector<int32_t>> outs;
  for (RequestId id : ids) outs.push_back(got[id * 1000]);
  return {outs, e.stats()};
}

void check_against_alone(model::Arch arch, bool moe = false, bool deepseek = false, int64_t window = 0) {
  // One thread: some 2000 tiny forwards, each a few parallel regions, crawl when ctest runs
  // another such test beside this one on 2 cores (each region waits for a descheduled
  // worker); what is checked does not depend on the thread count.
  struct OneThread {
    int before = base::num_threads();
    OneThread() { base::set_num_threads(1); }
    ~OneThread() { base::set_num_threads(before); }
  } one_thread;
  const model::Model m = make_model(arch, 5, moe, deepseek, window);
  std::mt19937 rng(42);
  const std::vector<int32_t> shared = random_tokens(rng, 40);  // a common prefix
  struct Req {
    std::vector<int32_t> prompt;
    int64_t max_tokens;
  };
  std::vector<Req> reqs;
  for (int i = 0; i < 64; ++i) {
    Req r;
    if (i % 3 == 0) r.prompt = shared;
    const auto tail = random_tokens(rng, 1 + rng() % 90);
    r.prompt.insert(r.prompt.end(), tail.begin(), tail.end());
    r.max_tokens = 1 + rng() % 24;
    reqs.push_back(r);
  }
  EngineConfig ec;
  ec.block_size = 8;
  ec.max_num_batched_tokens = 64;  // long prompts are chunked
  ec.max_num_seqs = 32;
  ec.max_model_len = 256;
  // 48 blocks of 8 tokens for up to 32 running sequences: preemption is certain.
  ec.kv_cache_memory = 48 * KvPool::bytes_per_block(m.config(), ec.block_size);
  Engine e(m, ec);
  std::vector<RequestId> ids;
  for (const auto& r : reqs) {
    SamplingParams p;
    p.max_tokens = r.max_tokens;
    p.ignore_eos = true;
    ids.push_back(e.add_request(r.prompt, p));
  }
  const auto got = run_all(e);
  const EngineStats st = e.stats();
  // (Under a sliding window the released blocks keep the same pool from running short.)
  if (window == 0) {
    EXPECT_GT(st.preemptions, 0) << "the tiny pool should have forced preemption";
  }
  EXPECT_GT(st.prefix_hit_blocks, 0) << "the shared prefix should hit the cache";
  EXPECT_EQ(st.kv_blocks_used, 0) << "blocks leaked";
  const std::vector<int64_t> load = m.expert_load();  // before dense_greedy adds its own
  for (size_t i = 0; i < reqs.size(); ++i) {
    EXPECT_EQ(got.at(ids[i] * 1000), dense_greedy(m, reqs[i].prompt, reqs[i].max_tokens))
        << "request " << i;
  }
  if (!moe) return;
  // Every token the engine forwarded went to 2 experts in each MoE layer (2; deepseek: 1).
  const int64_t per_token = deepseek ? 2 : 2 * 2;
  ASSERT_EQ(st.expert_tokens.size(), 4u);
  EXPECT_EQ(st.expert_tokens, load);
  int64_t slots = 0;
  for (int64_t v : st.expert_tokens) slots += v;
  EXPECT_GT(slots, 0);
  EXPECT_EQ(slots % per_token, 0);
  EXPECT_GE(slots, per_token * (st.prompt_tokens + st.generation_tokens - static_cast<int64_t>(reqs.size())));
}

// A mixture-of-experts model through chunked prefill, preemption and prefix caching: each
// token's experts depend on that token alone, so the output is each request's alone.
TEST(Engine, SixtyFourConcurrentGreedyRequestsEqualEachRunAloneMixtral) {
  check_against_alone(model::Arch::kLlama, true);
}

// DeepSeek-V3's latent attention from paged latent rows (prefix-shared, copied on write,
// preempted and recomputed) gives each request's output through the dense latent cache.
TEST(Engine, SixtyFourConcurrentGreedyRequestsEqualEachRunAloneDeepSeek) {
  check_against_alone(model::Arch::kLlama, true, true);
}

TEST(Engine, SixtyFourConcurrentGreedyRequestsEqualEachRunAloneLlama) {
  check_against_alone(model::Arch::kLlama);
}

TEST(Engine, SixtyFourConcurrentGreedyRequestsEqualEachRunAloneGpt2) {
  check_against_alone(model::Arch::kGpt2);
}

// Mistral's sliding window (13 positions, blocks of 8): the paged engine releases the blocks
// that leave the window (their stale table entries are never read) through chunked prefill,
// preemption and prefix hits, and each output is the dense window-masked path's.
TEST(Engine, SixtyFourConcurrentGreedyRequestsEqualEachRunAloneSlidingWindow) {
  check_against_alone(model::Arch::kLlama, false, false, 13);
}

// Gemma 2 in the paged engine: soft-capped scores scaled by query_pre_attn_scalar, windows on
// the even layers only (no block is released: the odd layers see everything), sandwich
// norms, GeGLU, the embedding scale and soft-capped logits give the dense path's outputs.
TEST(Engine, Gemma2PagedEqualsDense) {
  model::ModelConfig c = model::ModelConfig::named_shape("tiny");
  c.max_position_embeddings = 512;
  testing::make_gemma2(c, 24, 20.f, 30.f, 11);
  model::Model m = model::Model::random(c, DType::kF32, 12);
  auto& w = m.weights();  // widened head: no greedy choice within rounding of a tie
  Tensor& head = c.tie_word_embeddings ? w.embed : w.lm_head;
  for (int64_t i = 0; i < head.numel(); ++i) head.data<float>()[i] *= 8.f;
  w.tie(c);
  std::mt19937 rng(8);
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 6; ++i) prompts.push_back(random_tokens(rng, 3 + rng() % 40));

  EngineConfig ec;
  ec.block_size = 8;
  ec.max_num_batched_tokens = 32;
  ec.max_model_len = 256;
  // An f32 pool: the soft-capped logits of this random model leave near-ties (a 0.0016 gap)
  // that the default bf16 cache's rounding can flip; the paths themselves agree to ~1e-6.
  ec.kv_cache_dtype = kernels::KvCacheDtype::kF32;
  const auto [outs, st] = run_prompts(m, ec, prompts, 30, false);
  for (size_t i = 0; i < prompts.size(); ++i) EXPECT_EQ(outs[i], dense_greedy(m, prompts[i], 30)) << "request " << i;
  EXPECT_EQ(st.kv_blocks_used, 0);
}

// A pool of 8 blocks of 8 tokens holds no 200-token context, but under a 13-position window
// one request needs at most (13 + 16) / 8 + 2 blocks: long outputs decode in it, and equal
// the dense path's.
TEST(Engine, SlidingWindowDecodesPastWhatThePoolHolds) {
  const model::Model m = make_model(model::Arch::kLlama, 8, false, false, 13);
  std::mt19937 rng(3);
  const std::vector<std::vector<int32_t>> prompts = {random_tokens(rng, 37), random_tokens(rng, 5)};
  EngineConfig ec;
  ec.block_size = 8;
  ec.max_num_batched_tokens = 16;
  ec.max_num_seqs = 2;
  ec.max_model_len = 256;
  ec.kv_cache_memory = 8 * KvPool::bytes_per_block(m.config(), ec.block_size);
  const auto [outs, st] = run_prompts(m, ec, prompts, 160, false);
  for (size_t i = 0; i < prompts.size(); ++i) EXPECT_EQ(outs[i], dense_greedy(m, prompts[i], 160)) << "request " << i;
  EXPECT_EQ(st.kv_blocks_total, 8);
  EXPECT_EQ(st.kv_blocks_used, 0) << "blocks leaked";
  // Without the window the same pool refuses the context.
  EXPECT_THROW(Engine(make_model(model::Arch::kLlama, 8), ec), Error);
}

TEST(Engine, BatchInvariantLogprobsAreBitIdenticalWhateverTheBatch) {
  const model::Model m = make_model(model::Arch::kLlama, 9);
  std::mt19937 rng(3);
  const auto prompt = random_tokens(rng, 37);
  SamplingParams p;
  p.max_tokens = 6;
  p.logprobs = 3;
  p.ignore_eos = true;
  auto logprobs_of = [&](int others) {
    EngineConfig ec;
    ec.batch_invariant = true;
    ec.block_size = 16;
    ec.max_model_len = 256;
    ec.kv_cache_memory = 64 * KvPool::bytes_per_block(m.config(), 16);
    Engine e(m, ec);
    std::mt19937 r2(others);
    for (int i = 0; i < others; ++i) {
      SamplingParams q;
      q.max_tokens = 5;
      q.ignore_eos = true;
      e.add_request(random_tokens(r2, 5 + r2() % 60), q);
    }
    const RequestId id = e.add_request(prompt, p);
    std::vector<float> lp;
    while (e.has_unfinished())
      for (const auto& o : e.step())
        if (o.id == id)
          for (const auto& s : o.logprobs) {
            lp.push_back(s.logprob);
            for (const auto& t : s.top_logprobs) lp.push_back(t.logprob);
          }
    return lp;
  };
  const auto alone = logprobs_of(0);
  ASSERT_EQ(alone.size(), 6u * 4);
  for (int others : {1, 5, 12}) {
    const auto batched = logprobs_of(others);
    ASSERT_EQ(batched.size(), alone.size());
    for (size_t i = 0; i < alone.size(); ++i)
      EXPECT_EQ(batched[i], alone[i]) << others << " others, value " << i;  // bit-identical
  }
}

// Without batch_invariant too, a step made only of decode rows sends up to 8 rows to the
// skinny kernel (kernels::DecodeRows), whose rows do not depend on each other: six 1-token
// requests decoding side by side (every step 6 decode rows) get the same logprobs, bit for
// bit, as each one alone. (oneDNN, which ran 5 rows and more before, differs in the last bits.)
TEST(Engine, DecodeStepsOfUpToEightRowsGiveEachSequenceItsOwnBits) {
  if (!kernels::cpu_has(kernels::IsaLevel::kAvx2)) GTEST_SKIP() << "no AVX2: no skinny kernel";
  const model::Model m = make_model(model::Arch::kLlama, 11);
  SamplingParams p;
  p.max_tokens = 8;
  p.logprobs = 3;
  p.ignore_eos = true;
  auto logprobs_of = [&](const std::vector<int32_t>& firsts) {
    EngineConfig ec;
    ec.block_size = 8;
    ec.max_model_len = 64;
    ec.kv_cache_dtype = kernels::KvCacheDtype::kF32;
    Engine e(m, ec);
    std::vector<RequestId> ids;
    for (int32_t t : firsts) ids.push_back(e.add_request({t}, p));
    std::map<RequestId, std::vector<float>> lp;
    while (e.has_unfinished())
      for (const auto& o : e.step())
        for (const auto& s : o.logprobs) {
          lp[o.id].push_back(s.logprob);
          for (const auto& t : s.top_logprobs) lp[o.id].push_back(t.logprob);
        }
    std::vector<std::vector<float>> out;
    for (RequestId id : ids) out.push_back(lp[id]);
    return out;
  };
  const std::vector<int32_t> firsts = {5, 17, 42, 99, 123, 200};
  const auto batched = logprobs_of(firsts);
  for (size_t i = 0; i < firsts.size(); ++i) {
    const auto alone = logprobs_of({firsts[i]});
    ASSERT_EQ(alone[0].size(), 8u * 4);
    EXPECT_EQ(batched[i], alone[0]) << "request " << i;  // bit-identical
  }
}

TEST(Engine, SeededSamplingReproducesAndSamplesFork) {
  const model::Model m = make_model(model::Arch::kLlama, 13);
  std::mt19937 rng(8);
  const auto prompt = random_tokens(rng, 29);
  SamplingParams p;
  p.temperature = 0.9f;
  p.top_p = 0.95f;
  p.seed = 1234;
  p.n = 3;
  p.max_tokens = 12;
  p.ignore_eos = true;
  auto run = [&] {
    EngineConfig ec;
    ec.batch_invariant = true;
    ec.block_size = 8;
    ec.max_model_len = 256;
    ec.kv_cache_memory = 64 * KvPool::bytes_per_block(m.config(), 8);
    Engine e(m, ec);
    const RequestId id = e.add_request(prompt, p);
    auto got = run_all(e);
    EXPECT_EQ(e.stats().kv_blocks_used, 0);
    std::vector<std::vector<int32_t>> samples;
    for (int k = 0; k < 3; ++k) samples.push_back(got[id * 1000 + k]);
    return samples;
  };
  const auto a = run(), b = run();
  EXPECT_EQ(a, b) << "same seed, same samples";
  for (const auto& s : a) EXPECT_EQ(s.size(), 12u);
  EXPECT_NE(a[0], a[1]);
  EXPECT_NE(a[1], a[2]);
}

TEST(Engine, AbortFreesBlocksAndBadRequestsAreErrors) {
  const model::Model m = make_model(model::Arch::kLlama, 2);
  EngineConfig ec;
  ec.max_model_len = 128;
  ec.kv_cache_memory = 32 * KvPool::bytes_per_block(m.config(), 16);
  Engine e(m, ec);
  SamplingParams p;
  p.max_tokens = 50;
  p.ignore_eos = true;
  const RequestId a = e.add_request({5, 6, 7, 8, 9}, p);
  e.add_request({10, 11, 12}, p);
  e.step();
  e.step();
  e.abort_request(a);
  bool saw_abort = false;
  while (e.has_unfinished())
    for (const auto& o : e.step())
      if (o.id == a) saw_abort = o.finished && o.finish_reason == "abort";
  EXPECT_TRUE(saw_abort);
  EXPECT_EQ(e.stats().kv_blocks_used, 0);
  EXPECT_THROW(e.add_request({}, p), Error);
  EXPECT_THROW(e.add_request({1, 999}, p), Error);
  EXPECT_THROW(e.add_request(std::vector<int32_t>(128, 3), p), Error);
  SamplingParams bad;
  bad.top_p = 0;
  EXPECT_THROW(e.add_request({1, 2}, bad), Error);
}

}  // namespace
}  // namespace tessera::infer

namespace tessera::infer {
namespace {

// Prompt-lookup speculation: greedy outputs equal plain greedy decoding (proposals only
// decide how many positions one step verifies), and seeded sampling equals sampling
// without speculation (every emitted token is drawn from the target's distribution).
TEST(Engine, NgramSpeculationKeepsOutputsAndAcceptsProposals) {
  const model::Model m = make_model(model::Arch::kLlama, 21);
  std::mt19937 rng(5);
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 8; ++i) {
    auto p = random_tokens(rng, 20 + rng() % 30);
    const auto copy = p;  // repeated text gives the n-gram lookup something to find
    p.insert(p.end(), copy.begin(), copy.end());
    prompts.push_back(p);
  }
  auto run = [&](bool spec, bool sample) {
    EngineConfig ec;
    ec.block_size = 8;
    ec.max_model_len = 256;
    ec.kv_cache_memory = 256 * KvPool::bytes_per_block(m.config(), 8);
    if (spec) {
      ec.speculative_method = "ngram";
      ec.num_speculative_tokens = 4;
    }
    return run_prompts(m, ec, prompts, 40, sample);
  };
  const auto [plain, s0] = run(false, false);
  const auto [spec, s1] = run(true, false);
  EXPECT_EQ(spec, plain);
  EXPECT_GT(s1.spec_proposed, 0);
  EXPECT_GT(s1.spec_accepted, 0);
  EXPECT_LT(s1.steps, s0.steps) << "accepted proposals should save steps";
  const auto [plain_s, s2] = run(false, true);
  const auto [spec_s, s3] = run(true, true);
  EXPECT_EQ(spec_s, plain_s);
  EXPECT_GT(s3.spec_proposed, 0);
}

}  // namespace
}  // namespace tessera::infer

namespace tessera::infer {
namespace {

// Draft-model speculation: with the target itself as the draft every greedy proposal is
// accepted; with an unrelated draft few are; both give plain greedy's outputs.
// DeepSeek-V3's multi-token prediction module proposes the token after next from the
// main model's hidden states (and, chained on its own output, the ones after that):
// greedy outputs stay those of plain decoding, and seeded samples those of sampling
// without proposals.
// A random tiny DeepSeek-V3 with its prediction module (untied: a head of its own).
model::Model mtp_model(uint32_t seed, bool tied = true) {
  model::ModelConfig c = make_model(model::Arch::kLlama, 5, true, true).config();
  c.mtp_layers = 1;
  if (!tied) c.tie_word_embeddings = false;
  return model::Model::random(c, DType::kF32, seed);
}

// An engine of 64 blocks of 8 that proposes with the module.
EngineConfig mtp_engine(const model::Model& m, int64_t k) {
  EngineConfig ec;
  ec.block_size = 8;
  ec.max_model_len = 128;
  ec.kv_cache_memory = 64 * KvPool::bytes_per_block(m.config(), ec.block_size);
  ec.speculative_method = "mtp";
  ec.num_speculative_tokens = k;
  return ec;
}

TEST(Engine, MtpSpeculationKeepsGreedyOutputs) {
  model::Model m = mtp_model(11);
  for (float& v : std::span(m.weights().lm_head.data<float>(), m.weights().lm_head.numel())) v *= 8.f;
  std::mt19937 rng(3);
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 6; ++i) prompts.push_back(random_tokens(rng, 5 + rng() % 30));
  const EngineConfig ec = mtp_engine(m, 1);
  auto run = [&](bool spec, bool sample) {
    EngineConfig c = ec;
    if (!spec) c.speculative_method.clear(), c.num_speculative_tokens = 0;
    return run_prompts(m, c, prompts, 20, sample);
  };
  const auto [greedy, s0] = run(true, false);
  for (size_t i = 0; i < prompts.size(); ++i) EXPECT_EQ(greedy[i], dense_greedy(m, prompts[i], 20)) << "request " << i;
  EXPECT_GT(s0.spec_proposed, 0);
  // Seeded sampling: the same tokens as without proposals (each position samples the
  // target's distribution; a proposal only decides how many positions one step verifies).
  const auto [sampled, s1] = run(true, true);
  EXPECT_EQ(sampled, run(false, true).first);
  EXPECT_GT(s1.spec_proposed, 0);
  // A request whose prompt hits the prefix cache: the module starts at its first computed
  // position (it never saw the cached ones) and still proposes; the output stays exact.
  {
    Engine e(m, ec);
    std::vector<int32_t> prompt = random_tokens(rng, 40);
    SamplingParams sp;
    sp.max_tokens = 20;
    sp.ignore_eos = true;
    e.add_request(prompt, sp);
    run_all(e);
    const EngineStats before = e.stats();
    prompt.push_back(9);
    const RequestId id = e.add_request(prompt, sp);
    const auto got = run_all(e);
    const EngineStats after = e.stats();
    EXPECT_GT(after.prefix_hit_blocks, before.prefix_hit_blocks);
    EXPECT_GT(after.spec_proposed, before.spec_proposed);
    EXPECT_EQ(got.at(id * 1000), dense_greedy(m, prompt, 20));
  }
  // Three tokens per step: the module chained on its own output proposes the two after its
  // first; greedy and seeded outputs unchanged, and more proposed per step than with one.
  {
    EngineConfig c3 = ec;
    c3.num_speculative_tokens = 3;
    const auto [greedy3, s3] = run_prompts(m, c3, prompts, 20, false);
    EXPECT_EQ(greedy3, greedy);
    EXPECT_GT(s3.spec_proposed, s0.spec_proposed);
    EXPECT_EQ(run_prompts(m, c3, prompts, 20, true).first, sampled);
  }
  // A model without the module: a one-line error.
  EXPECT_THROW(Engine(make_model(model::Arch::kLlama, 5), ec), Error);
}

// A module that is always right: every block's output projections are zero (the residual
// stream is the token's embedding, so the main model's next token is a function f of the
// current one), every norm weight 1, and the module's eh_proj takes the embedding half (it
// predicts f of the token it is given). Then every proposal, the chained ones included,
// is the main model's own next token: all accepted, 3 per step with k = 3.
TEST(Engine, MtpChainedProposalsAreAllAcceptedWhenTheModuleIsRight) {
  model::Model m = mtp_model(12, false);
  auto& w = m.weights();
  const int64_t H = m.config().hidden_size;
  for (auto& L : w.layers) {
    for (Tensor* t : {&L.mla.o, &L.down.weight, &L.moe.down})
      if (t->defined()) t->zero();
  }
  for (Tensor* t : {&w.final_norm_w, &w.mtp.enorm, &w.mtp.hnorm, &w.mtp.head_norm}) t->fill(1.f);
  w.mtp.eh_proj.zero();
  for (int64_t i = 0; i < H; ++i) w.mtp.eh_proj.data<float>()[i * 2 * H + i] = 1.f;
  for (float& v : std::span(w.lm_head.data<float>(), w.lm_head.numel())) v *= 8.f;
  std::mt19937 rng(4);
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 3; ++i) prompts.push_back(random_tokens(rng, 6 + rng() % 10));
  for (const int64_t k : {1, 3}) {
    SCOPED_TRACE("k = " + std::to_string(k));
    const EngineConfig ec = mtp_engine(m, k);
    const auto [got, st] = run_prompts(m, ec, prompts, 24, false);
    for (size_t i = 0; i < prompts.size(); ++i) EXPECT_EQ(got[i], dense_greedy(m, prompts[i], 24)) << "request " << i;
    EXPECT_GT(st.spec_proposed, 0);
    EXPECT_EQ(st.spec_accepted, st.spec_proposed);
    // Each step after the prompt's verifies k proposals and adds k + 1 tokens.
    EXPECT_GE(st.spec_proposed, static_cast<int64_t>(prompts.size()) * k * (24 / (k + 1) - 1));
  }
}

TEST(Engine, DraftModelSpeculationKeepsGreedyOutputs) {
  const model::Model target = make_model(model::Arch::kLlama, 31);
  const model::Model other = make_model(model::Arch::kLlama, 32);
  std::mt19937 rng(6);
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 6; ++i) prompts.push_back(random_tokens(rng, 10 + rng() % 40));
  auto run = [&](const model::Model* draft) {
    EngineConfig ec;
    ec.block_size = 8;
    ec.max_model_len = 256;
    ec.kv_cache_memory = 256 * KvPool::bytes_per_block(target.config(), 8);
    if (draft) {
      ec.speculative_method = "draft";
      ec.num_speculative_tokens = 3;
    }
    Engine e(target, ec, nullptr, draft);
    std::vector<RequestId> ids;
    for (const auto& p : prompts) {
      SamplingParams sp;
      sp.max_tokens = 20;
      sp.ignore_eos = true;
      ids.push_back(e.add_request(p, sp));
    }
    auto got = run_all(e);
    std::vector<std::vector<int32_t>> outs;
    for (RequestId id : ids) outs.push_back(got[id * 1000]);
    return std::pair(outs, e.stats());
  };
  const auto [plain, s0] = run(nullptr);
  const auto [self, s1] = run(&target);
  const auto [unrelated, s2] = run(&other);
  EXPECT_EQ(self, plain);
  EXPECT_EQ(unrelated, plain);
  EXPECT_GT(s1.spec_proposed, 0);
  EXPECT_EQ(s1.spec_accepted, s1.spec_proposed) << "the target as its own draft is always right";
  EXPECT_LT(s2.spec_accepted, s2.spec_proposed);
}

}  // namespace
}  // namespace tessera::infer
