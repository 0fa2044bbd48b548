// The head quantized too (--quantize-lm-head, int8 per output channel): the logits are
// those of the float model whose head (and block linears) hold the dequantized weights,
// each head element stays within half a step of its float weight, decode reads fewer bytes, and
// the model saves as GPTQModel's "lm_head": true (AutoGPTQ tensors under "lm_head.") that
// loads back to identical logits, tied or untied. QLoRA through a quantized head trains as
// over its dequantized float model.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <functional>

#include "tessera/io/json_file.h"
#include "tessera/io/safetensors.h"
#include "tessera/kernels/bf16_speed.h"
#include "tessera/model/gguf_model.h"
#include "tessera/model/lora.h"
#include "tessera/model/model.h"
#include "tessera/model/quantize.h"
#include "model/parity_fixture.h"
#include "tessera/kernels/quant.h"
#include "test_util/lora_adapters.h"
#include "test_util/tensor_diff.h"

namespace tessera {
namespace {

namespace fs = std::filesystem;
using tessera::testing::max_abs;
using tessera::testing::max_abs_diff;

Tensor logits_of(const model::Model& m) {
  auto cache = model::KVCache::create(m.config(), 32);
  return m.forward({1, 5, 9, 33, 2, 77, 100, 3, 4, 200, 17, 8}, cache, true);
}

model::QuantizeOptions with_head(const char* scheme, int64_t group) {
  auto o = model::quantize_options_for_scheme(scheme);
  o.group_size = group;
  o.lm_head = true;
  return o;
}

std::string temp_dir(const std::string& name) {
  return (fs::temp_directory_path() / ("tessera_qhead_" + std::to_string(::getpid()) + "_" + name)).string();
}

TEST(QuantizedHead, ComputesTheDequantizedHeadWithinHalfAStepOfTheFloatOne) {
  const auto c = model::ModelConfig::named_shape("tiny");
  ASSERT_FALSE(c.tie_word_embeddings);
  const model::Model ref = model::Model::random(c, DType::kF32, 3);
  const Tensor want = logits_of(ref);
  const Tensor W = ref.weights().lm_head;  // (V, H) f32
  for (const auto& [scheme, group] : {std::pair{"int8", int64_t{0}}, std::pair{"int4", int64_t{32}}}) {
    SCOPED_TRACE(scheme);
    model::Model body = model::Model::random(c, DType::kF32, 3);
    auto o = with_head(scheme, group);
    o.lm_head = false;
    model::quantize_model(body, o);
    model::Model q = model::Model::random(c, DType::kF32, 3);
    model::quantize_model(q, with_head(scheme, group));
    ASSERT_NE(q.quantized_lm_head(), nullptr);
    EXPECT_FALSE(q.weights().lm_head.defined()) << "the untied float head is freed";
    EXPECT_NE(q.weights_description().find(", lm_head int8"), std::string::npos) << q.weights_description();
    // int8 per channel, symmetric as AutoGPTQ's (codes 0..255 about 128): the scale is
    // 2 max|row| / 255 rounded to f16, and every element is within half a step of its float
    // weight, or at the top code (127 steps) for the row's largest positive ones.
    const Tensor deq = kernels::dequantize(*q.quantized_lm_head());
    for (int64_t v = 0; v < c.vocab_size; ++v) {
      float amax = 0, err = 0;
      for (int64_t j = 0; j < c.hidden_size; ++j) {
        const float w = W.data<float>()[v * c.hidden_size + j];
        amax = std::max(amax, std::fabs(w));
        err = std::max(err, std::fabs(deq.data<float>()[v * c.hidden_size + j] - w));
      }
      const float s = q.quantized_lm_head()->scales.data<float>()[v];
      ASSERT_NEAR(s, 2 * amax / 255, 2 * amax / 255 * 1e-3f) << "row " << v;
      ASSERT_LE(err, std::max(0.5f * s, amax - 127 * s) * 1.0001f) << "row " << v;
    }
    // The float model holding every dequantized weight, the head's included.
    model::Model d = model::Model::random(c, DType::kF32, 3);
    for (int64_t l = 0; l < c.num_layers; ++l)
      for (int w = 0; w < 4; ++w)
        d.weights().layers[l].linear(w).weight.copy_from(kernels::dequantize(*q.weights().layers[l].linear(w).quant));
    d.weights().lm_head.copy_from(deq);
    const Tensor got = logits_of(q);
    const float range = max_abs(want);
    const float dense_tol = kernels::bf16_native_gemm_faster() ? 1e-2f * range : 2e-4f * range;
    EXPECT_LT(max_abs_diff(got, logits_of(d)), dense_tol);
    EXPECT_GT(max_abs_diff(got, logits_of(body)), 0.f) << "the head's quantization changed nothing";
    EXPECT_LT(max_abs_diff(got, want), (std::string(scheme) == "int8" ? 0.03f : 0.15f) * range);
    // Decode reads the head at about a quarter of its f32 bytes.
    const int64_t head_f32 = c.vocab_size * c.hidden_size * 4;
    EXPECT_EQ(body.matmul_weight_bytes() - q.matmul_weight_bytes(),
              head_f32 - q.quantized_lm_head()->nbytes());
    EXPECT_LT(q.quantized_lm_head()->nbytes(), head_f32 / 3);
  }
}

TEST(QuantizedHead, SavesAsGptqModelsLmHeadAndLoadsBackToIdenticalLogits) {
  for (const bool tied : {false, true}) {
    for (int bits : {8, 4}) {
      SCOPED_TRACE(std::string(tied ? "tied" : "untied") + " bits " + std::to_string(bits));
      auto c = model::ModelConfig::named_shape("tiny");
      c.tie_word_embeddings = tied;
      const std::string dir = temp_dir(std::to_string(tied) + std::to_string(bits));
      fs::remove_all(dir);
      model::Model q = model::Model::random(c, DType::kF32, 4);
      const Tensor embed = q.weights().embed.clone();
      auto o = model::quantize_options("rtn", bits, bits == 4 ? 64 : 0);
      o.lm_head = true;
      model::quantize_model(q, o);
      q.save(dir);
      const auto qc = io::read_json_file(dir + "/config.json").at("quantization_config");
      EXPECT_EQ(qc.at("lm_head"), true);
      // The body at 4 bits g64 and the head at 8 bits per channel: GPTQModel's override.
      EXPECT_EQ(qc.contains("dynamic"), bits == 4);
      if (bits == 4) {
        EXPECT_EQ(qc.at("dynamic").at("+:lm_head").at("bits"), 8);
        EXPECT_EQ(qc.at("dynamic").at("+:lm_head").at("group_size"), -1);
      }
      const auto file = io::SafetensorsModel::open(dir);
      for (const char* t : {"lm_head.qweight", "lm_head.qzeros", "lm_head.scales", "lm_head.g_idx"})
        EXPECT_TRUE(file.has(t)) << t;
      EXPECT_FALSE(file.has("lm_head.weight"));
      EXPECT_EQ(file.get("lm_head.qweight").shape(), (Shape{c.hidden_size * 8 / 32, c.vocab_size}));
      const model::Model back = model::Model::load(dir);
      ASSERT_NE(back.quantized_lm_head(), nullptr);
      EXPECT_EQ(max_abs_diff(logits_of(back), logits_of(q)), 0.f);
      EXPECT_EQ(back.weights_description(), q.weights_description());
      EXPECT_EQ(max_abs_diff(back.weights().embed, embed), 0.f) << "the embedding table stays float";
      fs::remove_all(dir);
    }
  }
}

// GGUF export writes the quantized head dequantized, as it does the block linears: an f32
// export loads back (as a float model) to the logits of the quantized one.
TEST(QuantizedHead, GgufExportWritesTheDequantizedHead) {
  const auto c = model::ModelConfig::named_shape("tiny");
  model::Model q = model::Model::random(c, DType::kF32, 6);
  model::quantize_model(q, with_head("int8", 0));
  const std::string path = temp_dir("export.gguf");
  model::GgufExportOptions o;
  o.type = io::GgmlType::kF32;
  model::export_gguf(q, nullptr, path, o);
  const model::Model back = model::Model::load(path);
  EXPECT_FALSE(back.quantized());
  EXPECT_EQ(back.quantized_lm_head(), nullptr);
  EXPECT_EQ(max_abs_diff(back.weights().lm_head, kernels::dequantize(*q.quantized_lm_head())), 0.f);
  const Tensor want = logits_of(q);
  const float tol = (kernels::bf16_native_gemm_faster() ? 1e-2f : 2e-4f) * max_abs(want);
  EXPECT_LT(max_abs_diff(logits_of(back), want), tol);
  fs::remove(path);
}

TEST(QuantizedHead, WhatCannotHoldAQuantizedHeadIsAOneLineError) {
  const auto c = model::ModelConfig::named_shape("tiny");
  const auto error_of = [&](const std::function<void()>& f) -> std::string {
    try {
      f();
    } catch (const std::exception& e) {
      return e.what();
    }
    return "no error";
  };
  for (const auto& [scheme, want] : {std::pair{"fp8", "quantizing lm_head goes with int8 or int4"},
                                     std::pair{"w8a8", "quantizing lm_head goes with int8 or int4"}}) {
    model::Model m = model::Model::random(c, DType::kF32, 1);
    EXPECT_NE(error_of([&] { model::quantize_model(m, with_head(scheme, 0)); }).find(want), std::string::npos) << scheme;
  }
  model::Model m = model::Model::random(c, DType::kF32, 1);
  auto awq = model::quantize_options("awq", 4, 32);
  awq.lm_head = true;
  EXPECT_NE(error_of([&] { model::quantize_model(m, awq); }).find("awq keeps lm_head float"), std::string::npos);
  EXPECT_NE(error_of([&] { model::quantize_on_load(m, model::LoadQuantization("", true)); })
                .find("--quantize-lm-head goes with --quantization int8 or int4"),
            std::string::npos);
  // A head quantized over float linears has no checkpoint format.
  m.quantize_lm_head([](const Tensor& w) { return kernels::quantize_rtn(w, kernels::QuantScheme::kInt8, w.size(1), true, true); });
  EXPECT_NE(error_of([&] { m.save(temp_dir("refused")); }).find("quantized lm_head over float linears"),
            std::string::npos);
  EXPECT_FALSE(fs::exists(temp_dir("refused")));
}

// QLoRA over a checkpoint whose head is quantized (GPTQModel lm_head = True): the head's
// products run through its dequantized weight, so the adapters' gradients are those of the
// float model holding every dequantized weight.
TEST(QuantizedHead, QloraThroughAQuantizedHeadTrainsAsItsDequantizedFloatModel) {
  const std::string dir = testing::parity_dir("llama");
  ASSERT_FALSE(dir.empty());
  const auto base = io::SafetensorsFile::open(dir + "/reference.safetensors");
  const Tensor ids = base->get("input_ids").to(DType::kI32), targets = base->get("targets").to(DType::kI32);
  model::Model q = model::Model::load(dir, DType::kF32);
  ASSERT_FALSE(q.config().tie_word_embeddings);
  auto o = model::quantize_options("rtn", 8, 0);
  o.lm_head = true;
  model::quantize_model(q, o);
  model::Model f = model::Model::load(dir, DType::kF32);
  for (int64_t l = 0; l < f.config().num_layers; ++l)
    for (int which = 0; which < 4; ++which)
      f.weights().layers[l].linear(which).weight.copy_from(kernels::dequantize(*q.weights().layers[l].linear(which).quant));
  f.weights().lm_head.copy_from(kernels::dequantize(*q.quantized_lm_head()));
  f.refresh_compute_weights();
  model::LoraConfig lc;
  lc.rank = 4, lc.alpha = 8;
  lc.targets = {model::LoraModule::kQ, model::LoraModule::kV, model::LoraModule::kDown};
  const model::LoraWeights w = testing::trained_lora(q.config(), lc, 21, 0.05f);
  model::LoraWeights gq = model::LoraWeights::zeros_like(w), gf = model::LoraWeights::zeros_like(w);
  q.set_lora(&w, &gq);
  f.set_lora(&w, &gf);
  model::Params fq = model::Params::allocate_frozen(q.config()), ff = model::Params::allocate_frozen(f.config());
  const auto rq = q.forward_backward(ids, targets, fq), rf = f.forward_backward(ids, targets, ff);
  const bool bf16_gemm = kernels::bf16_native_gemm_faster();  // (as the QLoRA test in lora_test.cc allows)
  EXPECT_NEAR(rq.loss, rf.loss, bf16_gemm ? 5e-3 : 1e-4);
  const auto nq = gq.named(q.config()), nf = gf.named(f.config());
  ASSERT_EQ(nq.size(), nf.size());
  for (size_t i = 0; i < nq.size(); ++i)
    EXPECT_LT(testing::relative_error(nq[i].second, nf[i].second), bf16_gemm ? 5e-2 : 1e-3) << nq[i].first;
}

}  // namespace
}  // namespace tessera
