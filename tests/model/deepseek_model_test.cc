// DeepSeek-V2 / V3 model directories against the PyTorch references of tests/parity/
// (hf_models.DeepseekV2ForCausalLM, transcribed from modeling_deepseek.py): multi-head
// latent attention (V2: q_proj; V3: q_a/q_b with its norm), a dense first layer, then
// routed experts with shared experts (V2: softmax, group-limited greedy, scaled weights;
// V3: sigmoid, noaux_tc with a selection bias, renormalised and scaled), and V3's
// multi-token prediction module. Logits over a batch, through the latent KV cache and
// decoded token by token; the loss (and V3's module's loss) and every gradient under each
// recompute mode, assigned and accumulated; save and load under the checkpoint's names;
// the KV bytes per token against the formula; one-line errors for what is not supported.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <functional>
#include <limits>
#include <span>
#include <string>

#include "parity_fixture.h"
#include "tessera/io/json_file.h"
#include "tessera/model/activations.h"
#include "tessera/model/mla.h"
#include "tessera/model/model.h"
#include "tessera/model/perplexity.h"
#include "tessera/model/rope_scaling.h"

namespace tessera {
namespace {

using testing::parity_dir;
using testing::relative_error;
using testing::row;

class DeepseekModel : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    dir_ = parity_dir(GetParam());
    ASSERT_FALSE(dir_.empty());
    ref_ = io::SafetensorsFile::open(dir_ + "/reference.safetensors");
  }
  bool v3() const { return GetParam().rfind("deepseek_v3", 0) == 0; }
  bool yarn() const { return GetParam().find("_yarn") != std::string::npos; }
  Tensor ref(const std::string& name) const { return ref_->get(name); }
  std::string dir_;
  std::shared_ptr<io::SafetensorsFile> ref_;
};

TEST_P(DeepseekModel, ConfigReadsAsTheCheckpointDescribesIt) {
  const auto c = model::ModelConfig::load(dir_);
  EXPECT_TRUE(c.is_deepseek() && c.uses_mla() && c.is_moe());
  EXPECT_EQ(c.q_lora_rank, v3() ? 48 : 0);
  EXPECT_EQ(c.kv_lora_rank, 32);
  EXPECT_EQ(c.head_dim, 24);  // qk_nope + qk_rope
  EXPECT_FALSE(c.layer_is_moe(0));
  EXPECT_TRUE(c.layer_is_moe(1) && c.layer_is_moe(2));
  EXPECT_EQ(c.mlp_size(0), 96);
  EXPECT_EQ(c.mlp_size(1), (v3() ? 1 : 2) * 24);  // the shared experts
  EXPECT_EQ(c.mtp_layers, v3() ? 1 : 0);
  EXPECT_EQ(c.router_bias, v3());
  ASSERT_EQ(c.rope_scaling.has_value(), yarn());
  if (!yarn()) return;
  // DeepSeek's YaRN at the fixture's values (tests/parity/make_reference.py): factor 40 over
  // an original 128 positions blends frequency 1, keeps 0, divides 2 and 3 by 40; the
  // softmax scale takes mscale_all_dim's factor squared, cos and sin mscale's over it.
  const auto f = model::yarn_inv_freq(*c.rope_scaling, 8, c.rope_theta);
  ASSERT_EQ(f.size(), 4u);
  EXPECT_EQ(f[0], 1.0);
  EXPECT_EQ(static_cast<float>(f[1]), 0.051249999552965164f);
  EXPECT_EQ(static_cast<float>(f[2]), 0.0002500000118743628f);
  EXPECT_EQ(static_cast<float>(f[3]), 2.499999936844688e-05f);
  EXPECT_NEAR(model::yarn_softmax_factor(*c.rope_scaling), 1.5896261651208738, 1e-12);
  const double m = 0.1 * std::log(40.0) + 1.0, m_all = 0.1 * 0.707 * std::log(40.0) + 1.0;
  EXPECT_NEAR(model::yarn_attention_factor(*c.rope_scaling), v3() ? m / m_all : 1.0, 1e-12);
}

TEST_P(DeepseekModel, LogitsMatchPyTorchInABatchThroughTheLatentCacheAndDecoding) {
  const auto m = model::Model::load(dir_, DType::kF32);
  const Tensor ids = ref("input_ids"), want = ref("logits");
  EXPECT_LT(relative_error(m.forward_batch(ids.contiguous()), want), 1e-4);
  for (int64_t b = 0; b < ids.size(0); ++b) {
    auto cache = model::KVCache::create(m.config(), ids.size(1));
    EXPECT_FALSE(cache.v[0].defined());  // the latent rows only
    EXPECT_LT(relative_error(m.forward(row(ids, b), cache, true), want.select(0, b)), 1e-4) << "sequence " << b;
  }
  const auto tokens = row(ids, 1);
  auto cache = model::KVCache::create(m.config(), static_cast<int64_t>(tokens.size()));
  m.forward(std::vector<int32_t>(tokens.begin(), tokens.begin() + 5), cache);
  for (size_t t = 5; t < tokens.size(); ++t)
    EXPECT_LT(relative_error(m.forward({tokens[t]}, cache), want.select(0, 1).slice(0, t, t + 1)), 1e-4)
        << "token " << t;
}

TEST_P(DeepseekModel, LossAndEveryGradientMatchPyTorchUnderEachRecompute) {
  auto m = model::Model::load(dir_, DType::kF32);
  const double weight = v3() ? 0.3 : 0.0;  // the reference's mtp_loss_weight
  m.set_mtp_loss_weight(weight);
  const double want_main = v3() ? ref("loss_main").item_f32(0) : ref("loss").item_f32(0);
  for (auto rc : {model::Recompute::kNone, model::Recompute::kSelective, model::Recompute::kFull}) {
    SCOPED_TRACE(model::recompute_name(rc));
    m.set_recompute(rc);
    auto grads = model::Params::allocate(m.config(), DType::kF32);
    const auto r = m.forward_backward(ref("input_ids").contiguous(), ref("targets").contiguous(), grads);
    EXPECT_NEAR(r.loss, want_main, 1e-5 * want_main);
    if (v3()) {
      EXPECT_NEAR(r.mtp_loss, ref("loss_mtp").item_f32(0), 1e-5 * ref("loss_mtp").item_f32(0));
      EXPECT_NEAR(r.loss + weight * r.mtp_loss, ref("loss").item_f32(0), 1e-5 * ref("loss").item_f32(0));
      const Tensor t = ref("targets").contiguous();  // position i's module target: token i + 2
      int64_t want_count = 0;
      for (int64_t b = 0; b < t.size(0); ++b)
        for (int64_t i = 1; i < t.size(1); ++i) want_count += t.data<int32_t>()[b * t.size(1) + i] != -100;
      EXPECT_EQ(r.mtp_count, want_count);
    }
    int checked = 0, mtp = 0;
    for (const auto& [name, g] : grads.named(m.config())) {
      if (name.find("e_score_correction_bias") != std::string::npos) continue;  // not trained by gradients
      ASSERT_TRUE(ref_->has("grad." + name)) << "reference lacks grad." << name;
      EXPECT_LT(relative_error(g, ref("grad." + name)), 1e-3) << name;
      ++checked;
      mtp += name.rfind("model.layers.3.", 0) == 0;
    }
    EXPECT_GT(checked, v3() ? 120 : 80);
    EXPECT_EQ(mtp > 0, v3());
  }
}

// Training in bf16 (f32 masters, bf16 products as PyTorch autocast), native and emulated:
// the loss and the whole gradient's norm against the fp32 reference within bf16's
// tolerances. Gradient by gradient these tiny random models move by 8-40% in either mode
// (against fp32 and against each other): bf16 rounding flips a few tokens' expert choices
// (the expert loads differ by one or two slots), and every weight upstream follows.
TEST_P(DeepseekModel, TrainsInBf16NativeAndEmulated) {
  for (auto request : {model::Bf16Request::kNative, model::Bf16Request::kEmulated}) {
    SCOPED_TRACE(request == model::Bf16Request::kNative ? "native" : "emulated");
    auto m = model::Model::load(dir_, DType::kF32);
    m.set_mtp_loss_weight(v3() ? 0.3 : 0.0);
    m.set_compute_dtype_in_place(DType::kBF16, request);
    auto grads = model::Params::allocate(m.config(), DType::kF32);
    const auto r = m.forward_backward(ref("input_ids").contiguous(), ref("targets").contiguous(), grads);
    const double want = v3() ? ref("loss_main").item_f32(0) : ref("loss").item_f32(0);
    EXPECT_NEAR(r.loss, want, 2e-2 * want);
    double sq = 0, ref_sq = 0;
    for (const auto& [name, g] : grads.named(m.config())) {
      if (name.find("e_score_correction_bias") != std::string::npos) continue;
      for (float x : g.to_f32_vector()) sq += double(x) * x;
      for (float x : ref("grad." + name).to_f32_vector()) ref_sq += double(x) * x;
    }
    EXPECT_NEAR(std::sqrt(sq), std::sqrt(ref_sq), 0.1 * std::sqrt(ref_sq));
  }
}

TEST_P(DeepseekModel, AssignedGradientsOverwriteNaNsAndWithoutTheModuleItsGradientsAreZero) {
  auto m = model::Model::load(dir_, DType::kF32);
  m.set_mtp_loss_weight(v3() ? 0.3 : 0.0);
  auto grads = model::Params::allocate(m.config(), DType::kF32);
  for (auto& [name, g] : grads.named(m.config())) g.fill(std::numeric_limits<float>::quiet_NaN());
  const Tensor ids = ref("input_ids").contiguous(), targets = ref("targets").contiguous();
  m.forward_backward(ids, targets, grads, 1.f, model::Model::GradWrite::kAssign);
  for (const auto& [name, g] : grads.named(m.config())) {
    if (name.find("e_score_correction_bias") != std::string::npos) continue;
    EXPECT_LT(relative_error(g, ref("grad." + name)), 1e-3) << name;
  }
  if (!v3()) return;
  m.set_mtp_loss_weight(0.0);  // the module does not run: its gradients are assigned 0
  for (auto& [name, g] : grads.named(m.config())) g.fill(std::numeric_limits<float>::quiet_NaN());
  const auto r = m.forward_backward(ids, targets, grads, 1.f, model::Model::GradWrite::kAssign);
  EXPECT_NEAR(r.loss, ref("loss_main").item_f32(0), 1e-5 * ref("loss_main").item_f32(0));
  EXPECT_EQ(r.mtp_count, 0);
  for (const auto& [name, g] : grads.named(m.config())) {
    if (name.rfind("model.layers.3.", 0) != 0 || name.find("e_score_correction_bias") != std::string::npos) continue;
    for (float v : std::span(g.data<float>(), g.numel())) ASSERT_EQ(v, 0.f) << name;
  }
}

TEST_P(DeepseekModel, TheMtpModuleAtInferenceGivesTheTrainingLogitsPositionByPosition) {
  if (!v3()) GTEST_SKIP() << "deepseek_v2 has no multi-token prediction module";
  const auto m = model::Model::load(dir_, DType::kF32);
  const Tensor ids = ref("input_ids"), want = ref("mtp_logits");
  for (int64_t b = 0; b < ids.size(0); ++b) {
    const auto tokens = row(ids, b);
    const int64_t T = static_cast<int64_t>(tokens.size());
    auto cache = model::KVCache::create(m.config(), T);
    Tensor hidden;
    m.forward(tokens, cache, true, &hidden);
    // Position i from its hidden state and token i + 1; a prefill of 4 positions, then one by one.
    auto mtp = model::KVCache::create_mtp(m.config(), T);
    const std::vector<int32_t> next(tokens.begin() + 1, tokens.end());
    Tensor got = m.mtp_forward(std::vector<int32_t>(next.begin(), next.begin() + 4), hidden.slice(0, 0, 4), mtp);
    EXPECT_LT(relative_error(got, want.select(0, b).slice(0, 3, 4)), 1e-4) << "sequence " << b;
    for (int64_t i = 4; i < T - 1; ++i) {
      got = m.mtp_forward({next[i]}, hidden.slice(0, i, i + 1), mtp);
      EXPECT_LT(relative_error(got, want.select(0, b).slice(0, i, i + 1)), 1e-4) << "sequence " << b << " position " << i;
    }
    EXPECT_EQ(mtp.length, T - 1);
  }
}

TEST_P(DeepseekModel, RoutingDecisionsMatchPyTorchInEveryMoeLayer) {
  auto m = model::Model::load(dir_, DType::kF32);
  m.set_mtp_loss_weight(v3() ? 0.3 : 0.0);  // (the module's layer routes too)
  model::Activations acts;
  model::forward_train(m, ref("input_ids").contiguous(), acts);
  const auto& c = m.config();
  int checked = 0;
  for (int64_t l = 0; l < c.num_layers + c.mtp_layers; ++l) {
    if (!c.layer_is_moe(l)) continue;
    const std::string key = "experts." + std::to_string(l);
    ASSERT_TRUE(ref_->has(key)) << key;
    const Tensor want = ref(key).contiguous();  // (N, k) in torch.topk's order
    const model::MoeRouting& r = l < c.num_layers ? acts.layers[l].moe.routing : acts.mtp->layer.moe.routing;
    const int64_t N = want.size(0), k = want.size(1);
    ASSERT_EQ(r.tokens, N);
    ASSERT_EQ(r.top_k, k);
    for (int64_t n = 0; n < N; ++n) {  // the same set of experts per token (the order is the gate's)
      std::vector<int32_t> a(r.expert.begin() + n * k, r.expert.begin() + (n + 1) * k);
      std::vector<int32_t> b(want.data<int32_t>() + n * k, want.data<int32_t>() + (n + 1) * k);
      std::sort(a.begin(), a.end());
      std::sort(b.begin(), b.end());
      EXPECT_EQ(a, b) << "layer " << l << " token " << n;
    }
    ++checked;
  }
  EXPECT_EQ(checked, v3() ? 3 : 2);
}

TEST_P(DeepseekModel, PerplexityMatchesPyTorch) {
  const auto m = model::Model::load(dir_, DType::kF32);
  const auto ids = model::read_token_ids(dir_ + "/eval_ids.txt");
  const auto r = model::evaluate_perplexity(m, ids, static_cast<int64_t>(ref("eval_ctx").item_f32(0)));
  const double want = ref("eval_nll").item_f32(0);
  EXPECT_NEAR(r.mean_nll, want, 5e-5 * want);
}

TEST_P(DeepseekModel, SavesUnderTheCheckpointNamesAndLoadsBack) {
  const auto m = model::Model::load(dir_, DType::kF32);
  const std::string out =
      (std::filesystem::temp_directory_path() / ("tessera_deepseek_" + std::to_string(::getpid()))).string();
  std::filesystem::remove_all(out);
  m.save(out);
  const auto cfg = io::read_json_file(out + "/config.json"), orig = io::read_json_file(dir_ + "/config.json");
  for (const char* key : {"model_type", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                          "v_head_dim", "n_routed_experts", "n_shared_experts", "first_k_dense_replace",
                          "topk_method", "scoring_func", "n_group", "topk_group", "norm_topk_prob",
                          "routed_scaling_factor", "moe_intermediate_size", "intermediate_size"})
    EXPECT_EQ(cfg.at(key), orig.at(key)) << key;
  EXPECT_EQ(cfg.value("num_nextn_predict_layers", 0), orig.value("num_nextn_predict_layers", 0));
  // Every tensor of the checkpoint, the module's embedding and head copies included.
  EXPECT_EQ(io::SafetensorsModel::open(out).names(), io::SafetensorsModel::open(dir_).names());
  const auto back = model::Model::load(out, DType::kF32);
  const Tensor ids = ref("input_ids").contiguous();
  EXPECT_EQ(relative_error(back.forward_batch(ids), m.forward_batch(ids)), 0.0);
  std::filesystem::remove_all(out);
}

TEST_P(DeepseekModel, LatentCacheBytesPerTokenFollowTheFormula) {
  const auto c = model::ModelConfig::load(dir_);
  const model::MlaSpec s = [&] {
    model::MlaSpec spec;
    spec.heads = c.num_heads, spec.q_lora_rank = c.q_lora_rank, spec.kv_lora_rank = c.kv_lora_rank;
    spec.qk_nope = c.qk_nope_head_dim, spec.qk_rope = c.qk_rope_head_dim, spec.v_head = c.v_head_dim;
    return spec;
  }();
  // (kv_lora + rope) values per token and layer against heads x (qk + v) for multi-head
  // attention: (32 + 8) / (4 x (24 + 16)) = 25% here; DeepSeek-V3's 576 / (128 x 320) = 1.4%.
  EXPECT_EQ(model::mla_cache_bytes_per_token(s, 2), (32 + 8) * 2);
  EXPECT_EQ(model::mha_cache_bytes_per_token(s, 2), 4 * (24 + 16) * 2);
  auto cache = model::KVCache::create(c, 10);
  EXPECT_EQ(static_cast<int64_t>(cache.k.size()), c.num_layers + c.mtp_layers);
  EXPECT_EQ(cache.k[0].numel() * 4, 10 * model::mla_cache_bytes_per_token(s, 4));
}

TEST_P(DeepseekModel, WhatIsNotSupportedYetIsAOneLineError) {
  auto expect_error = [](const std::function<void()>& fn, const std::string& needle) {
    try {
      fn();
      ADD_FAILURE() << "no error for " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
    }
  };
  expect_error([&] { model::Model::load(dir_, DType::kF32, model::TpShard{0, 3}); },
               "tp = 3 does not divide num_attention_heads = 4");
  nlohmann::json cfg = io::read_json_file(dir_ + "/config.json");
  cfg["rope_scaling"] = {{"type", "linear"}, {"factor", 4}};
  expect_error([&] { model::ModelConfig::from_json(cfg, "c.json"); }, "latent attention's rope_scaling must be yarn");
  cfg["rope_scaling"] = {{"type", "yarn"}, {"factor", 40}};
  expect_error([&] { model::ModelConfig::from_json(cfg, "c.json"); }, "'original_max_position_embeddings' (as DeepSeek");
  cfg = io::read_json_file(dir_ + "/config.json");
  cfg["scoring_func"] = "tanh";
  expect_error([&] { model::ModelConfig::from_json(cfg, "c.json"); }, "'scoring_func' tanh is not supported");
  cfg = io::read_json_file(dir_ + "/config.json");
  cfg["num_nextn_predict_layers"] = 2;
  expect_error([&] { model::ModelConfig::from_json(cfg, "c.json"); }, "'num_nextn_predict_layers' must be in [0, 1]");
  cfg = io::read_json_file(dir_ + "/config.json");
  cfg["topk_group"] = 1;  // one group of 2 experts cannot hold 3 chosen ones
  cfg["num_experts_per_tok"] = 3;
  expect_error([&] { model::ModelConfig::from_json(cfg, "c.json"); }, "'topk_group' 1 groups of 2 experts");
  auto m = model::Model::load(dir_, DType::kF32);
  if (!v3()) expect_error([&] { m.set_mtp_loss_weight(0.3); }, "has no multi-token prediction module");
}

INSTANTIATE_TEST_SUITE_P(Archs, DeepseekModel,
                         ::testing::Values("deepseek_v2", "deepseek_v3", "deepseek_v2_yarn", "deepseek_v3_yarn",
                                           "deepseek_v2_aux"));

}  // namespace
}  // namespace tessera
