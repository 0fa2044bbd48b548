// A Mixtral model directory (model_type mixtral: Llama attention, sparse MoE MLPs) against
// the PyTorch reference of tests/parity/ (hf_models.MixtralSparseMoeBlock, transcribed from
// transformers' modeling_mixtral.py): logits over a batch, through the KV cache and decoded
// token by token, perplexity; the training loss with its balancing term and every gradient;
// the Hugging Face names save and load back; what is not supported yet for MoE models is a
// one-line error.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <functional>
#include <string>

#include "parity_fixture.h"
#include "tessera/io/json_file.h"
#include "tessera/model/model.h"
#include "tessera/model/perplexity.h"
#include "tessera/model/quantize.h"

namespace tessera {
namespace {

using testing::parity_dir;
using testing::relative_error;

std::vector<int32_t> row(const Tensor& ids, int64_t b) {
  const Tensor r = ids.select(0, b).contiguous();
  return std::vector<int32_t>(r.data<int32_t>(), r.data<int32_t>() + r.numel());
}

TEST(MixtralModel, LogitsMatchPyTorchInABatchThroughTheCacheAndDecoding) {
  const std::string dir = parity_dir("mixtral");
  ASSERT_FALSE(dir.empty());
  const auto ref = io::SafetensorsFile::open(dir + "/reference.safetensors");
  const auto m = model::Model::load(dir, DType::kF32);
  EXPECT_TRUE(m.config().is_moe());
  EXPECT_EQ(m.config().num_experts, 4);
  EXPECT_EQ(m.config().experts_per_token, 2);
  const Tensor ids = ref->get("input_ids"), want = ref->get("logits");
  EXPECT_LT(relative_error(m.forward_batch(ids.contiguous()), want), 1e-4);
  for (int64_t b = 0; b < ids.size(0); ++b) {
    auto cache = model::KVCache::create(m.config(), ids.size(1));
    EXPECT_LT(relative_error(m.forward(row(ids, b), cache, true), want.select(0, b)), 1e-4) << "sequence " << b;
  }
  // Token by token after a prefill: each step routes one token.
  const auto tokens = row(ids, 1);
  auto cache = model::KVCache::create(m.config(), static_cast<int64_t>(tokens.size()));
  m.forward(std::vector<int32_t>(tokens.begin(), tokens.begin() + 5), cache);
  for (size_t t = 5; t < tokens.size(); ++t)
    EXPECT_LT(relative_error(m.forward({tokens[t]}, cache), want.select(0, 1).slice(0, t, t + 1)), 1e-4)
        << "token " << t;
}

TEST(MixtralModel, PerplexityMatchesPyTorch) {
  const std::string dir = parity_dir("mixtral");
  ASSERT_FALSE(dir.empty());
  const auto ref = io::SafetensorsFile::open(dir + "/reference.safetensors");
  const auto m = model::Model::load(dir, DType::kF32);
  const auto ids = model::read_token_ids(dir + "/eval_ids.txt");
  const auto r = model::evaluate_perplexity(m, ids, static_cast<int64_t>(ref->get("eval_ctx").item_f32(0)));
  const double want = ref->get("eval_nll").item_f32(0);
  EXPECT_NEAR(r.mean_nll, want, 5e-5 * want);
}

// The loss with its balancing term (router_aux_loss_coef x load_balancing_loss_func over
// both layers' tokens, as MixtralForCausalLM adds under output_router_logits) and every
// gradient, under each activation-checkpointing mode.
TEST(MixtralModel, LossWithTheBalancingTermAndEveryGradientMatchPyTorch) {
  const std::string dir = parity_dir("mixtral");
  ASSERT_FALSE(dir.empty());
  const auto ref = io::SafetensorsFile::open(dir + "/reference.safetensors");
  auto m = model::Model::load(dir, DType::kF32);
  ASSERT_TRUE(m.config().output_router_logits);
  for (auto rc : {model::Recompute::kNone, model::Recompute::kSelective, model::Recompute::kFull}) {
    SCOPED_TRACE(model::recompute_name(rc));
    m.set_recompute(rc);
    auto grads = model::Params::allocate(m.config(), DType::kF32);
    const auto r = m.forward_backward(ref->get("input_ids").contiguous(), ref->get("targets").contiguous(), grads);
    const double want = ref->get("loss").item_f32(0);
    EXPECT_NEAR(r.loss, want, 1e-5 * want);
    int checked = 0;
    for (const auto& [name, g] : grads.named(m.config())) {
      ASSERT_TRUE(ref->has("grad." + name)) << "reference lacks grad." << name;
      EXPECT_LT(relative_error(g, ref->get("grad." + name)), 1e-3) << name;
      ++checked;
    }
    EXPECT_EQ(checked, 2 * (1 + 4 + 1 + 1 + 3 * 4) + 3);  // per layer: norms, q/k/v/o, router, experts
    // Assigned gradients overwrite whatever was there.
    auto again = model::Params::allocate(m.config(), DType::kF32);
    for (auto& [name, g] : again.named(m.config())) g.fill(7.f);
    m.forward_backward(ref->get("input_ids").contiguous(), ref->get("targets").contiguous(), again, 1.f,
                       model::Model::GradWrite::kAssign);
    for (const auto& [name, g] : again.named(m.config()))
      EXPECT_LT(relative_error(g, ref->get("grad." + name)), 1e-3) << "assigned " << name;
  }
}

TEST(MixtralModel, SavesUnderTransformersNamesAndLoadsBack) {
  const std::string dir = parity_dir("mixtral");
  ASSERT_FALSE(dir.empty());
  const auto m = model::Model::load(dir, DType::kF32);
  const std::string out =
      (std::filesystem::temp_directory_path() / ("tessera_mixtral_" + std::to_string(::getpid()))).string();
  std::filesystem::remove_all(out);
  m.save(out);
  const auto cfg = io::read_json_file(out + "/config.json");
  EXPECT_EQ(cfg.at("model_type"), "mixtral");
  EXPECT_EQ(cfg.at("num_local_experts"), 4);
  EXPECT_EQ(cfg.at("num_experts_per_tok"), 2);
  const auto file = io::SafetensorsModel::open(out);
  for (const char* name : {"model.layers.1.block_sparse_moe.gate.weight", "model.layers.0.block_sparse_moe.experts.3.w1.weight",
                           "model.layers.0.block_sparse_moe.experts.3.w2.weight", "model.layers.1.block_sparse_moe.experts.0.w3.weight"})
    EXPECT_TRUE(file.has(name)) << name;
  const auto back = model::Model::load(out, DType::kF32);
  const auto ref = io::SafetensorsFile::open(dir + "/reference.safetensors");
  const Tensor ids = ref->get("input_ids").contiguous();
  EXPECT_EQ(relative_error(back.forward_batch(ids), m.forward_batch(ids)), 0.0);
  std::filesystem::remove_all(out);
}

TEST(MixtralModel, WhatIsNotSupportedYetIsAOneLineError) {
  const std::string dir = parity_dir("mixtral");
  ASSERT_FALSE(dir.empty());
  auto expect_error = [](const std::function<void()>& fn, const std::string& needle) {
    try {
      fn();
      ADD_FAILURE() << "no error for " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
    }
  };
  auto m = model::Model::load(dir, DType::kF32);
  const auto ref = io::SafetensorsFile::open(dir + "/reference.safetensors");
  expect_error([&] { model::Model::load(dir, DType::kF32, model::TpShard{0, 2}); },
               "tensor parallelism over mixture-of-experts layers is not supported yet");
  expect_error([&] { model::quantize_on_load(m, "int8"); }, "quantizing mixture-of-experts models is not supported yet");
  // Config fields the layer cannot honour.
  nlohmann::json cfg = io::read_json_file(dir + "/config.json");
  cfg["router_jitter_noise"] = 0.1;
  expect_error([&] { model::ModelConfig::from_json(cfg, "c.json"); }, "'router_jitter_noise' 0.1 is not supported");
  cfg["router_jitter_noise"] = 0.0;
  cfg["num_experts_per_tok"] = 5;
  expect_error([&] { model::ModelConfig::from_json(cfg, "c.json"); }, "num_experts_per_tok");
}

}  // namespace
}  // namespace tessera
