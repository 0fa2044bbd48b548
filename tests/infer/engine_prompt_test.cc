// Requests that read their prompt: prompt log-probabilities (vLLM's prompt_logprobs) equal
// log_softmax of Model::forward's dense logits at every position (values, ranks and top
// alternatives computed here from the formula), and embedding requests equal the mean over
// positions of the dense forward's final-norm hidden states; both through chunked prefill,
// batching with generation requests, preemption, prefix-cache hits they must not use, and
// speculative decoding beside them.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <random>

#include <unistd.h>

#include <filesystem>

#include "tessera/base/thread_pool.h"
#include "tessera/infer/engine.h"
#include "tessera/infer/tp_serving.h"

namespace tessera::infer {
namespace {

model::Model make_model(uint64_t seed) {
  model::ModelConfig c = model::ModelConfig::named_shape("tiny");
  c.max_position_embeddings = 512;
  model::Model m = model::Model::random(c, DType::kF32, seed);
  // Widen the head so the log-probabilities spread over several nats (random weights give
  // nearly flat logits) and the ranks are clear-cut.
  Tensor& head = c.tie_word_embeddings ? m.weights().embed : m.weights().lm_head;
  for (int64_t i = 0; i < head.numel(); ++i) head.data<float>()[i] *= 8.f;
  m.weights().tie(c);
  return m;
}

std::vector<int32_t> random_tokens(std::mt19937& rng, int64_t n) {
  std::vector<int32_t> t(n);
  for (auto& x : t) x = static_cast<int32_t>(3 + rng() % 250);
  return t;
}

// The dense reference: every position's logits (T, V) and final hidden states (T, H).
struct Dense {
  Tensor logits, hidden;
};
Dense dense_forward(const model::Model& m, const std::vector<int32_t>& prompt) {
  model::KVCache cache = model::KVCache::create(m.config(), static_cast<int64_t>(prompt.size()));
  Dense d;
  d.logits = m.forward(prompt, cache, true, &d.hidden);
  return d;
}

// Prompt token i's log-probability from the dense logits of position i - 1: log_softmax in
// double, the rank by counting (ties: lower id first), the top k by sorting.
void expect_prompt_logprobs(const model::Model& m, const std::vector<int32_t>& prompt, int top,
                            const std::vector<PromptLogprob>& got, const std::string& what) {
  ASSERT_EQ(got.size(), prompt.size() - 1) << what;
  const Dense d = dense_forward(m, prompt);
  const int64_t V = m.config().vocab_size;
  for (size_t i = 1; i < prompt.size(); ++i) {
    const float* x = d.logits.data<float>() + (i - 1) * V;
    double mx = -1e300, sum = 0;
    for (int64_t v = 0; v < V; ++v) mx = std::max(mx, static_cast<double>(x[v]));
    for (int64_t v = 0; v < V; ++v) sum += std::exp(x[v] - mx);
    const double lse = mx + std::log(sum);
    const PromptLogprob& g = got[i - 1];
    const int32_t t = prompt[i];
    EXPECT_EQ(g.token, t) << what << " position " << i;
    EXPECT_NEAR(g.logprob, x[t] - lse, 2e-4) << what << " position " << i;
    std::vector<int32_t> order(V);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [x](int32_t a, int32_t b) { return x[a] > x[b]; });
    const int64_t rank = std::find(order.begin(), order.end(), t) - order.begin() + 1;
    EXPECT_EQ(g.rank, rank) << what << " position " << i;
    ASSERT_EQ(g.top.size(), static_cast<size_t>(top)) << what;
    for (int k = 0; k < top; ++k) {
      EXPECT_EQ(g.top[k].token, order[k]) << what << " position " << i << " alternative " << k;
      EXPECT_NEAR(g.top[k].logprob, x[order[k]] - lse, 2e-4) << what;
    }
  }
}

struct OneThread {  // many tiny forwards: parallel regions only cost time on 2 shared cores
  int before = base::num_threads();
  OneThread() { base::set_num_threads(1); }
  ~OneThread() { base::set_num_threads(before); }
};

struct Collected {
  std::map<std::pair<RequestId, int64_t>, std::vector<PromptLogprob>> prompt_lps;  // (id, sample)
  std::map<std::pair<RequestId, int64_t>, int> prompt_lp_outputs;  // outputs that carried them
  std::map<std::pair<RequestId, int64_t>, std::vector<int32_t>> tokens;
  std::map<RequestId, RequestOutput> finished;  // sample 0's last output
};

Collected run_all(Engine& e) {
  Collected c;
  for (int guard = 0; e.has_unfinished(); ++guard) {
    EXPECT_LT(guard, 100000) << "no progress";
    if (guard >= 100000) break;
    for (auto& o : e.step()) {
      const auto key = std::make_pair(o.id, o.index);
      auto& t = c.tokens[key];
      t.insert(t.end(), o.new_tokens.begin(), o.new_tokens.end());
      if (!o.prompt_logprobs.empty()) {
        c.prompt_lps[key] = o.prompt_logprobs;
        ++c.prompt_lp_outputs[key];
      }
      if (o.finished && o.index == 0) c.finished[o.id] = o;
    }
  }
  return c;
}

EngineConfig small_config(const model::Model& m, int64_t blocks) {
  EngineConfig ec;
  ec.block_size = 8;
  ec.max_num_batched_tokens = 24;  // prompts of 25+ tokens prefill in chunks
  ec.max_model_len = 128;
  ec.kv_cache_dtype = kernels::KvCacheDtype::kF32;  // as the dense path's cache
  ec.kv_cache_memory = blocks * KvPool::bytes_per_block(m.config(), ec.block_size, m.dims().kv_heads,
                                                        ec.kv_cache_dtype);
  return ec;
}

TEST(EnginePromptLogprobs, EqualLogSoftmaxOfTheDenseForwardAtEveryPosition) {
  OneThread one;
  const model::Model m = make_model(21);
  std::mt19937 rng(5);
  Engine e(m, small_config(m, 256));
  // The first prompt runs alone first: its blocks are cached, and the prompt_logprobs
  // request for the same prompt must compute them anyway.
  const auto shared = random_tokens(rng, 57);
  SamplingParams warm;
  warm.max_tokens = 2;
  warm.ignore_eos = true;
  e.add_request(shared, warm);
  run_all(e);
  struct Req {
    std::vector<int32_t> prompt;
    int top;
    int64_t n;
    RequestId id = 0;
  };
  std::vector<Req> reqs = {{shared, 5, 1},           {random_tokens(rng, 1), 2, 1}, {random_tokens(rng, 2), 0, 1},
                           {random_tokens(rng, 9), 3, 1}, {random_tokens(rng, 40), 20, 2}, {random_tokens(rng, 70), 1, 1}};
  RequestId shared_plain = 0;
  for (auto& r : reqs) {
    SamplingParams p;
    p.max_tokens = 6;
    p.ignore_eos = true;
    p.prompt_logprobs = r.top;
    if (r.n > 1) {
      p.n = r.n;
      p.temperature = 0.9f;
      p.seed = 3;
    }
    r.id = e.add_request(r.prompt, p);
    if (r.prompt == shared) shared_plain = e.add_request(shared, warm);  // this one may hit
    SamplingParams plain;  // ordinary requests in the same steps
    plain.max_tokens = 4;
    plain.ignore_eos = true;
    e.add_request(random_tokens(rng, 3 + rng() % 30), plain);
  }
  const Collected c = run_all(e);
  EXPECT_GT(c.finished.at(shared_plain).num_cached_tokens, 0) << "the shared prompt should be cached";
  for (const auto& r : reqs) {
    const std::string what = "prompt of " + std::to_string(r.prompt.size());
    EXPECT_EQ(c.finished.at(r.id).num_cached_tokens, 0) << what << ": prompt logprobs must not read the prefix cache";
    for (int64_t k = 0; k < r.n; ++k) {
      const auto key = std::make_pair(r.id, k);
      EXPECT_EQ(c.tokens.at(key).size(), 6u) << what;
      if (r.prompt.size() == 1) {
        EXPECT_FALSE(c.prompt_lps.count(key)) << "a one-token prompt has no prompt logprobs";
        continue;
      }
      ASSERT_TRUE(c.prompt_lps.count(key)) << what << " sample " << k;
      EXPECT_EQ(c.prompt_lp_outputs.at(key), 1) << what << ": once per sample";
      expect_prompt_logprobs(m, r.prompt, r.top, c.prompt_lps.at(key), what);
    }
  }
  EXPECT_EQ(e.stats().kv_blocks_used, 0);
}

TEST(EnginePromptLogprobs, SurvivePreemptionAndRecomputation) {
  OneThread one;
  const model::Model m = make_model(22);
  std::mt19937 rng(9);
  // 24 blocks of 8 tokens for 12 requests of up to 80 tokens: preemption is certain.
  Engine e(m, small_config(m, 24));
  std::vector<std::pair<RequestId, std::vector<int32_t>>> reqs;
  for (int i = 0; i < 12; ++i) {
    SamplingParams p;
    p.max_tokens = 20;
    p.ignore_eos = true;
    p.prompt_logprobs = 2;
    auto prompt = random_tokens(rng, 30 + rng() % 30);
    reqs.emplace_back(e.add_request(prompt, p), prompt);
  }
  const Collected c = run_all(e);
  EXPECT_GT(e.stats().preemptions, 0) << "the tiny pool should have forced preemption";
  for (const auto& [id, prompt] : reqs) {
    const auto key = std::make_pair(id, int64_t{0});
    EXPECT_EQ(c.prompt_lp_outputs.at(key), 1);
    expect_prompt_logprobs(m, prompt, 2, c.prompt_lps.at(key), "request " + std::to_string(id));
  }
  EXPECT_EQ(e.stats().kv_blocks_used, 0);
}

void expect_mean_hidden(const model::Model& m, const std::vector<int32_t>& prompt, const std::vector<float>& got,
                        const std::string& what) {
  const int64_t H = m.config().hidden_size, T = static_cast<int64_t>(prompt.size());
  ASSERT_EQ(static_cast<int64_t>(got.size()), H) << what;
  const Dense d = dense_forward(m, prompt);
  double err = 0, norm = 0;
  for (int64_t j = 0; j < H; ++j) {
    double mean = 0;  // written out here: sum over positions, divided by their count
    for (int64_t t = 0; t < T; ++t) mean += d.hidden.data<float>()[t * H + j];
    mean /= static_cast<double>(T);
    err = std::max(err, std::abs(got[j] - mean));
    norm = std::max(norm, std::abs(mean));
  }
  EXPECT_LT(err, 1e-5 * std::max(1.0, norm)) << what << " (largest |mean| " << norm << ")";
}

TEST(EngineEmbeddings, MeanOfTheFinalNormHiddenStates) {
  OneThread one;
  const model::Model m = make_model(23);
  std::mt19937 rng(4);
  for (bool spec : {false, true}) {
    EngineConfig ec = small_config(m, 24);
    if (spec) {  // proposals go to decodes only: an embedding's last prefill token is none
      ec.speculative_method = "ngram";
      ec.num_speculative_tokens = 3;
    }
    Engine e(m, ec);
    // Lengths: 1, a 25-token prompt whose second chunk is one token, the whole context,
    // and a repeat of an earlier one (its blocks are cached by then, and must not be used).
    std::vector<std::vector<int32_t>> inputs = {random_tokens(rng, 1), random_tokens(rng, 25), random_tokens(rng, 128),
                                                random_tokens(rng, 48)};
    std::vector<RequestId> ids;
    for (const auto& in : inputs) ids.push_back(e.add_embedding_request(in));
    std::vector<RequestId> gen;
    for (int i = 0; i < 6; ++i) {
      SamplingParams p;
      p.max_tokens = 12;
      p.ignore_eos = true;
      std::vector<int32_t> prompt = random_tokens(rng, 10 + rng() % 40);
      for (int r = 0; r < 3; ++r) prompt.insert(prompt.end(), prompt.begin(), prompt.begin() + 6);  // n-gram food
      gen.push_back(e.add_request(prompt, p));
    }
    Collected c = run_all(e);
    inputs.push_back(inputs[3]);
    ids.push_back(e.add_embedding_request(inputs[3]));
    const Collected again = run_all(e);
    c.finished.insert(again.finished.begin(), again.finished.end());
    for (size_t i = 0; i < inputs.size(); ++i) {
      const std::string what = "input " + std::to_string(i) + (spec ? " (ngram)" : "");
      const RequestOutput& o = c.finished.at(ids[i]);
      EXPECT_EQ(o.finish_reason, "stop") << what;
      EXPECT_EQ(o.num_output_tokens, 0) << what;
      EXPECT_EQ(o.num_cached_tokens, 0) << what;
      EXPECT_TRUE(c.tokens[std::make_pair(ids[i], int64_t{0})].empty()) << what;
      expect_mean_hidden(m, inputs[i], o.embedding, what);
    }
    for (RequestId id : gen) EXPECT_EQ(c.tokens[std::make_pair(id, int64_t{0})].size(), 12u);
    if (!spec) {
      EXPECT_GT(e.stats().preemptions, 0) << "the tiny pool should have forced preemption";
    }
    EXPECT_EQ(e.stats().kv_blocks_used, 0);
  }
}

TEST(EngineEmbeddings, ChecksTheInputAndAborts) {
  const model::Model m = make_model(24);
  Engine e(m, small_config(m, 40));
  std::mt19937 rng(1);
  try {
    e.add_embedding_request(random_tokens(rng, 129));
    FAIL() << "a 129-token input in a 128-token context";
  } catch (const FieldError& err) {
    EXPECT_EQ(err.field(), "prompt");
  }
  EXPECT_THROW(e.add_embedding_request({}), FieldError);
  EXPECT_THROW(e.add_embedding_request({1, 100000}), FieldError);
  EXPECT_THROW(e.add_embedding_request({1, 2}, 0), FieldError);  // no LoRA adapter 0
  const RequestId id = e.add_embedding_request(random_tokens(rng, 100));
  e.step();  // its first chunk ran
  e.abort_request(id);
  const Collected c = run_all(e);
  EXPECT_EQ(c.finished.at(id).finish_reason, "abort");
  EXPECT_TRUE(c.finished.at(id).embedding.empty());
  EXPECT_FALSE(e.has_unfinished());
  EXPECT_EQ(e.stats().kv_blocks_used, 0);
}

// Tensor parallelism: the prompt rows and hidden states come from rank 0's step like the
// sampled rows; at tp 2 (threads) the values equal one process's.
TEST(EnginePromptLogprobs, TensorParallelEqualsOneProcess) {
  const std::string dir =
      (std::filesystem::temp_directory_path() / ("tessera_prompt_tp_" + std::to_string(::getpid()))).string();
  make_model(25).save(dir);
  std::mt19937 rng(6);
  const std::vector<std::vector<int32_t>> prompts = {random_tokens(rng, 30), random_tokens(rng, 7)};
  struct Got {
    std::vector<std::vector<PromptLogprob>> lps;
    std::vector<std::vector<float>> embeddings;
  };
  auto run = [&](int tp) {
    Got got;
    run_tensor_parallel(tp, dir, DType::kF32, [&](const model::Model& m, TpGroup* g) {
      EngineConfig ec = small_config(m, 64);
      ec.kv_cache_memory = 64 * KvPool::bytes_per_block(m.config(), ec.block_size, m.dims().kv_heads,
                                                         ec.kv_cache_dtype);
      Engine e(m, ec, nullptr, nullptr, g);
      std::vector<RequestId> lp_ids, emb_ids;
      for (const auto& p : prompts) {
        SamplingParams sp;
        sp.max_tokens = 3;
        sp.ignore_eos = true;
        sp.prompt_logprobs = 3;
        lp_ids.push_back(e.add_request(p, sp));
        emb_ids.push_back(e.add_embedding_request(p));
      }
      const Collected c = run_all(e);
      for (RequestId id : lp_ids) got.lps.push_back(c.prompt_lps.at({id, 0}));
      for (RequestId id : emb_ids) got.embeddings.push_back(c.finished.at(id).embedding);
      return 0;
    });
    return got;
  };
  const Got one = run(1), two = run(2);
  std::filesystem::remove_all(dir);
  for (size_t i = 0; i < prompts.size(); ++i) {
    ASSERT_EQ(two.lps[i].size(), one.lps[i].size());
    for (size_t k = 0; k < one.lps[i].size(); ++k) {
      EXPECT_NEAR(two.lps[i][k].logprob, one.lps[i][k].logprob, 1e-4);
      EXPECT_EQ(two.lps[i][k].rank, one.lps[i][k].rank);
      for (size_t t = 0; t < one.lps[i][k].top.size(); ++t) EXPECT_EQ(two.lps[i][k].top[t].token, one.lps[i][k].top[t].token);
    }
    ASSERT_EQ(two.embeddings[i].size(), one.embeddings[i].size());
    for (size_t j = 0; j < one.embeddings[i].size(); ++j) EXPECT_NEAR(two.embeddings[i][j], one.embeddings[i][j], 1e-4);
  }
}

}  // namespace
}  // namespace tessera::infer
