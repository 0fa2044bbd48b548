// Tensor-parallel serving: the engine on rank 0 and its steps run by every rank's shard
// (threads of this process). Greedy output is token-identical to one process for a single
// request and for a batch that shares a prefix (prefix caching, copy-on-write, continuous
// batching), at tp 2 (kv heads split) and tp 4 (kv heads replicated, as vLLM does); each
// rank's KV cache holds only its kv heads.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <map>

#include "tessera/base/error.h"
#include "tessera/infer/engine.h"
#include "tessera/infer/generate.h"
#include "tessera/infer/tp_serving.h"
#include "tessera/model/model.h"
#include "test_util/deepseek_config.h"
#include "test_util/scratch_dir.h"

namespace tessera::infer {
namespace {

namespace fs = std::filesystem;

// A random model of config c saved under a temp dir, its weights scaled up (norms aside):
// peaked logits, so greedy choices are clear.
std::string saved_model(const model::ModelConfig& c, const std::string& tag, uint64_t seed) {
  const std::string d = testing::scratch_dir(tag);
  model::Model m = model::Model::random(c, DType::kF32, seed);
  for (auto& [name, t] : m.weights().named(c)) {
    Tensor f = t;
    for (int64_t i = 0; i < f.numel(); ++i) f.data<float>()[i] *= name.find("norm") == std::string::npos ? 4.f : 1.f;
  }
  m.save(d);
  return d;
}

std::string model_dir() {
  static const std::string dir = [] {
    model::ModelConfig c = model::ModelConfig::named_shape("tiny");
    c.vocab_size = 301;  // uneven over 2 and 4 ranks (vocab-parallel head)
    c.num_layers = 3;
    c.max_position_embeddings = 256;
    return saved_model(c, "tessera_tp_serving_", 17);
  }();
  return dir;
}

std::vector<int32_t> greedy(int tp, const std::vector<int32_t>& prompt, int64_t n) {
  std::vector<int32_t> out;
  run_tensor_parallel(tp, model_dir(), DType::kF32, [&](const model::Model& m, TpGroup* g) {
    EXPECT_EQ(g != nullptr, tp > 1);
    EXPECT_EQ(m.tp_shard().size, tp);
    GenerateOptions o;
    o.max_tokens = n;
    o.stop_at_eos = false;
    o.tp = g;
    out = generate(m, prompt, o).tokens;
    return 0;
  });
  return out;
}

TEST(TpServing, GreedyGenerationIsTokenIdenticalToOneProcess) {
  const std::vector<int32_t> prompt = {5, 77, 12, 250, 3, 9, 140, 41, 8, 61, 33, 2};
  const auto want = greedy(1, prompt, 24);
  ASSERT_EQ(want.size(), 24u);
  EXPECT_EQ(greedy(2, prompt, 24), want);
  EXPECT_EQ(greedy(4, prompt, 24), want);  // 2 kv heads: each on 2 of the 4 ranks
}

// Several requests at once, two of them sharing a long prefix (the second reuses the
// first's cached blocks), with small blocks and a small token budget (chunked prefill),
// on the model in `dir` over tp x ep ranks: each request's tokens, and the expert loads
// rank 0 reports (mixture-of-experts models).
struct BatchRun {
  std::vector<std::vector<int32_t>> outs;
  std::vector<int64_t> load;
};

BatchRun run_batch(const std::string& dir, int tp, int ep = 1) {
  BatchRun r;
  run_tensor_parallel(tp, dir, DType::kF32, [&](const model::Model& m, TpGroup* g) {
    EXPECT_EQ(g != nullptr, ep * tp > 1);
    if (m.config().is_moe()) {  // only its experts
      EXPECT_EQ(m.weights().layers[m.config().num_layers - 1].moe.gate_up.size(0), 4 / ep);
    }
    EngineConfig ec;
    ec.block_size = 4;
    ec.kv_cache_memory = 512 * KvPool::bytes_per_block(m.config(), 4, m.dims().kv_heads);
    ec.max_num_batched_tokens = 16;
    Engine engine(m, ec, nullptr, nullptr, g);
    std::vector<int32_t> shared;
    for (int i = 0; i < 22; ++i) shared.push_back((i * 37 + 11) % 301);
    std::vector<std::vector<int32_t>> prompts = {shared, shared, {1, 2, 3}, {200, 100, 50, 25, 9}};
    prompts[1].push_back(7);
    SamplingParams p;
    p.max_tokens = 12;
    p.ignore_eos = true;
    std::vector<RequestId> ids;
    for (const auto& pr : prompts) ids.push_back(engine.add_request(pr, p));
    std::map<RequestId, std::vector<int32_t>> got;
    while (engine.has_unfinished())
      for (const auto& o : engine.step()) got[o.id].insert(got[o.id].end(), o.new_tokens.begin(), o.new_tokens.end());
    for (RequestId id : ids) r.outs.push_back(got[id]);
    EXPECT_GT(engine.stats().prefix_hit_blocks, 0);
    r.load = m.expert_load();
    return 0;
  }, "", ep);
  return r;
}

std::vector<std::vector<int32_t>> batch(int tp) { return run_batch(model_dir(), tp).outs; }

TEST(TpServing, ABatchWithASharedPrefixIsTokenIdenticalToOneProcess) {
  const auto want = batch(1);
  ASSERT_EQ(want.size(), 4u);
  for (const auto& w : want) EXPECT_EQ(w.size(), 12u);
  EXPECT_EQ(batch(2), want);
}

TEST(TpServing, EachRankCachesItsKvHeadsAndBadTpIsOneLine) {
  const auto c = model::ModelConfig::load(model_dir());
  // tiny: 2 kv heads. tp 2: one per rank, half the bytes per block.
  EXPECT_EQ(2 * KvPool::bytes_per_block(c, 16, 1), KvPool::bytes_per_block(c, 16));
  try {
    run_tensor_parallel(3, model_dir(), DType::kF32, [](const model::Model&, TpGroup*) { return 0; });
    ADD_FAILURE() << "tp 3 accepted";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("--tp 3"), std::string::npos) << msg;
    EXPECT_NE(msg.find("does not divide num_attention_heads = 4"), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
}

// Expert-parallel serving (--ep): a Mixtral model's 4 experts split over 2 and 4 ranks,
// every rank running each step over its own cache, each MoE layer's rows split between
// the ranks and gathered. Greedy output is token-identical to one process; so are the
// expert loads rank 0 reports (every rank's rows counted). So is --tp 2 on the same model
// (attention split, experts replicated).
std::string moe_dir() {
  static const std::string dir = [] {
    model::ModelConfig c = model::ModelConfig::named_shape("tiny");
    c.model_type = "mixtral";
    c.vocab_size = 301;
    c.num_layers = 3;
    c.max_position_embeddings = 256;
    c.num_experts = 4;
    c.experts_per_token = 2;
    c.moe_intermediate_size = c.intermediate_size;
    return saved_model(c, "tessera_ep_serving_", 23);
  }();
  return dir;
}

using EpRun = BatchRun;
EpRun ep_batch(int ep, int tp = 1) { return run_batch(moe_dir(), tp, ep); }

TEST(EpServing, MixtureOfExpertsBatchIsTokenIdenticalToOneProcess) {
  const EpRun want = ep_batch(1);
  ASSERT_EQ(want.outs.size(), 4u);
  for (const auto& w : want.outs) EXPECT_EQ(w.size(), 12u);
  ASSERT_EQ(want.load.size(), 4u);
  for (int ep : {2, 4}) {
    const EpRun got = ep_batch(ep);
    EXPECT_EQ(got.outs, want.outs) << "ep " << ep;
    EXPECT_EQ(got.load, want.load) << "ep " << ep;
  }
  // --tp over the same model: the attention split, the experts replicated.
  const EpRun tp2 = ep_batch(1, 2);
  EXPECT_EQ(tp2.outs, want.outs) << "tp 2";
  EXPECT_EQ(tp2.load, want.load) << "tp 2";
  const EpRun tp2_ep2 = ep_batch(2, 2);  // the attention over tp 2, the experts over ep 2
  EXPECT_EQ(tp2_ep2.outs, want.outs) << "tp 2 x ep 2";
  EXPECT_EQ(tp2_ep2.load, want.load) << "tp 2 x ep 2";
  try {
    run_tensor_parallel(1, moe_dir(), DType::kF32, [](const model::Model&, TpGroup*) { return 0; }, "", 3);
    ADD_FAILURE() << "ep 3 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--ep 3"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("does not divide the model's 4 experts"), std::string::npos) << e.what();
  }
}

// A DeepSeek-V3 model (latent attention, a dense first layer, then 4 routed experts and a
// shared one) served over tp 2 (the heads and the dense and shared MLPs split, the latent
// rows and the routed experts replicated), over ep 2 and over tp 2 x ep 2 (4 ranks):
// token-identical to one process, with the same expert loads.
std::string deepseek_dir() {
  static const std::string dir = [] {
    model::ModelConfig c = testing::tiny_deepseek_v3(301, 3, 2);
    c.max_position_embeddings = 256;
    return saved_model(c, "tessera_ds_serving_", 29);
  }();
  return dir;
}

TEST(TpServing, DeepSeekOverTpAndEpIsTokenIdenticalToOneProcess) {
  const BatchRun want = run_batch(deepseek_dir(), 1);
  ASSERT_EQ(want.outs.size(), 4u);
  for (const auto& w : want.outs) EXPECT_EQ(w.size(), 12u);
  for (const auto& [tp, ep] : {std::pair<int, int>{2, 1}, {1, 2}, {2, 2}}) {
    const BatchRun got = run_batch(deepseek_dir(), tp, ep);
    EXPECT_EQ(got.outs, want.outs) << "tp " << tp << " ep " << ep;
    EXPECT_EQ(got.load, want.load) << "tp " << tp << " ep " << ep;
  }
}

}  // namespace
}  // namespace tessera::infer
