// Packed rows (several documents in one training row, positions restarting at each): the
// loss and every gradient equal the sum over the documents run alone, for each family the
// parity fixtures hold (RoPE variants, sliding windows, soft-capping, GPT-2's learned
// positions, mixture of experts), under each activation-checkpointing mode. (Mixtral's
// balancing loss is a statistic of the whole batch, so it runs without it here: packing
// changes that term in transformers too.)
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/parity_fixture.h"
#include "tessera/base/error.h"
#include "tessera/kernels/cross_entropy.h"
#include "tessera/model/model.h"

namespace tessera {
namespace {

using model::Model;
using model::Params;

struct Doc {
  std::vector<int32_t> ids, targets;  // targets -100 where not trained on
};

std::vector<Doc> make_docs(const std::vector<int64_t>& lengths, int64_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<Doc> docs;
  for (int64_t n : lengths) {
    Doc d;
    for (int64_t t = 0; t < n; ++t) d.ids.push_back(static_cast<int32_t>(rng() % vocab));
    for (int64_t t = 0; t < n; ++t)  // the last token has no target; some others are masked
      d.targets.push_back(t + 1 < n && (rng() % 4 != 0) ? d.ids[t + 1] : kernels::kIgnoreIndex);
    d.targets[0] = d.ids.size() > 1 ? d.ids[1] : kernels::kIgnoreIndex;  // at least one target
    docs.push_back(d);
  }
  return docs;
}

int64_t count(const Doc& d) {
  int64_t n = 0;
  for (int32_t t : d.targets) n += t != kernels::kIgnoreIndex;
  return n;
}

// Rows of T: docs in order, each row padded by a pad document (token 0, no targets).
model::TokenBatch pack(const std::vector<std::vector<Doc>>& rows, int64_t T) {
  const int64_t B = static_cast<int64_t>(rows.size());
  model::TokenBatch b{Tensor::empty({B, T}, DType::kI32), Tensor::empty({B, T}, DType::kI32),
                      Tensor::empty({B, T}, DType::kI32)};
  for (int64_t r = 0; r < B; ++r) {
    int64_t at = 0;
    for (const Doc& d : rows[r])
      for (size_t t = 0; t < d.ids.size(); ++t, ++at) {
        b.ids.data<int32_t>()[r * T + at] = d.ids[t];
        b.targets.data<int32_t>()[r * T + at] = d.targets[t];
        b.positions.data<int32_t>()[r * T + at] = static_cast<int32_t>(t);
      }
    for (int32_t p = 0; at < T; ++at, ++p) {
      b.ids.data<int32_t>()[r * T + at] = 0;
      b.targets.data<int32_t>()[r * T + at] = kernels::kIgnoreIndex;
      b.positions.data<int32_t>()[r * T + at] = p;
    }
  }
  return b;
}

class Packed : public ::testing::TestWithParam<std::string> {};

TEST_P(Packed, LossAndGradientsEqualTheDocumentsRunAlone) {
  std::string dir = testing::parity_dir(GetParam());
  ASSERT_FALSE(dir.empty());
  if (GetParam() == "mixtral") {  // the fixture without its balancing loss
    const std::string copy = (std::filesystem::temp_directory_path() /
                              ("tessera_packed_mixtral_" + std::to_string(::getpid()))).string();
    std::filesystem::remove_all(copy);
    std::filesystem::copy(dir, copy);
    nlohmann::json c = nlohmann::json::parse(std::ifstream(copy + "/config.json"));
    c["output_router_logits"] = false;
    std::ofstream(copy + "/config.json") << c.dump();
    dir = copy;
  }
  Model m = Model::load(dir, DType::kF32);
  if (GetParam() == "mixtral") std::filesystem::remove_all(dir);
  const int64_t V = m.config().vocab_size;
  // Two rows of 24: documents of 7, 1, 9 and 3 tokens (1: a document with no target), then
  // 11 and 13. Windows in the fixtures (4-5 tokens) are shorter than the longer documents.
  const auto docs = make_docs({7, 1, 9, 3, 11, 13}, V, 17);
  const std::vector<std::vector<Doc>> rows = {{docs[0], docs[1], docs[2], docs[3]}, {docs[4], docs[5]}};
  const model::TokenBatch batch = pack(rows, 24);
  int64_t total = 0;
  for (const Doc& d : docs) total += count(d);
  for (auto rc : {model::Recompute::kNone, model::Recompute::kSelective, model::Recompute::kFull}) {
    m.set_recompute(rc);
    Params g_packed = Params::allocate(m.config(), DType::kF32);
    const auto r = m.forward_backward(batch.ids, batch.targets, g_packed, 1.f, Model::GradWrite::kAccumulate,
                                      batch.positions);
    ASSERT_EQ(r.count, total);
    // Each document alone (one row of its own length, positions 0..n-1), its gradient
    // weighted by its share of the targets: their sum is the packed batch's mean.
    Params g_alone = Params::allocate(m.config(), DType::kF32);
    double loss_sum = 0;
    for (const Doc& d : docs) {
      const int64_t n = static_cast<int64_t>(d.ids.size()), c = count(d);
      if (c == 0) continue;
      const Tensor ids = Tensor::from_vector(d.ids, {1, n}), targets = Tensor::from_vector(d.targets, {1, n});
      const auto a = m.forward_backward(ids, targets, g_alone, static_cast<float>(c) / static_cast<float>(total));
      loss_sum += a.loss * static_cast<double>(c);
    }
    EXPECT_NEAR(r.loss * static_cast<double>(total), loss_sum, 1e-5 * loss_sum) << model::recompute_name(rc);
    const auto pn = g_packed.named(m.config()), an = g_alone.named(m.config());
    ASSERT_EQ(pn.size(), an.size());
    for (size_t i = 0; i < pn.size(); ++i)
      EXPECT_LT(testing::relative_error(pn[i].second, an[i].second), 2e-5)
          << pn[i].first << " under " << model::recompute_name(rc);
  }
  // The forward alone (evaluation): each document's logits are its own run's.
  const Tensor logits = m.forward_batch(batch.ids, batch.positions);
  const Doc& d = docs[2];
  const Tensor alone = m.forward_batch(Tensor::from_vector(d.ids, {1, 9}));
  EXPECT_LT(testing::relative_error(logits.select(0, 0).slice(0, 8, 17), alone.select(0, 0)), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Families, Packed,
                         ::testing::Values("llama", "qwen2", "qwen3", "gemma2", "gpt2", "mixtral",
                                           "llama_rope_dynamic", "qwen2_rope_yarn", "llama_mistral_window",
                                           "qwen2_sliding_window"),
                         [](const auto& info) { return info.param; });

TEST(PackedPositions, BadNumberingIsAnError) {
  const std::string dir = testing::parity_dir("llama");
  ASSERT_FALSE(dir.empty());
  const Model m = Model::load(dir, DType::kF32);
  const Tensor ids = Tensor::from_vector(std::vector<int32_t>{1, 2, 3, 4}, {1, 4});
  Params g = Params::allocate(m.config(), DType::kF32);
  for (const auto& [pos, what] : std::vector<std::pair<std::vector<int32_t>, std::string>>{
           {{1, 2, 3, 4}, "row 0, token 0 is 1"}, {{0, 1, 3, 4}, "token 2 is 3"}, {{0, 1, 0, 2}, "token 3 is 2"}}) {
    try {
      m.forward_backward(ids, ids, g, 1.f, Model::GradWrite::kAccumulate, Tensor::from_vector(pos, {1, 4}));
      ADD_FAILURE() << "no error for " << what;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace tessera
