// LoRA training passes against PyTorch (tests/parity/lora_grad_reference.py: PEFT's LoraLayer
// forward transcribed, frozen base): the loss, the logits and the gradient of every A and B,
// for each llama-family fixture; the frozen base computes no base gradient; dropout's
// backward against finite differences of its own forward; what LoRA refuses.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <random>

#include "test_util/lora_adapters.h"
#include "model/parity_fixture.h"
#include "test_util/run_command.h"
#include "test_util/throws.h"
#include "tessera/io/safetensors.h"
#include "tessera/model/lora.h"
#include "tessera/model/lora_io.h"
#include "tessera/model/quantize.h"
#include "tessera/kernels/bf16_speed.h"
#include "tessera/kernels/quant.h"
#include "tessera/model/model.h"

namespace tessera {
namespace {

namespace fs = std::filesystem;
using model::LoraConfig;
using model::LoraModule;
using model::LoraWeights;
using model::Model;
using model::Params;

LoraConfig all_modules(int64_t rank, double alpha) {
  LoraConfig c;
  c.rank = rank;
  c.alpha = alpha;
  c.targets = {LoraModule::kQ, LoraModule::kK, LoraModule::kV, LoraModule::kO,
               LoraModule::kGate, LoraModule::kUp, LoraModule::kDown};
  return c;
}

std::string temp_path(const std::string& name) {
  return (fs::temp_directory_path() / ("tessera_lora_" + std::to_string(::getpid()) + "_" + name)).string();
}

class LoraParity : public ::testing::TestWithParam<std::string> {};

TEST_P(LoraParity, LossLogitsAndAdapterGradientsEqualPyTorch) {
  const std::string dir = testing::parity_dir(GetParam());
  ASSERT_FALSE(dir.empty());
  Model m = Model::load(dir, DType::kF32);
  const auto& c = m.config();
  const LoraConfig config = all_modules(4, 8);
  LoraWeights w = testing::trained_lora(c, config, 5, 0.05f);
  const std::string adapter = temp_path(GetParam() + "_adapter.safetensors"), out = temp_path(GetParam() + "_ref.safetensors");
  io::save_safetensors(adapter, w.named(c));
  const auto r = testing::run_command(std::string(TESSERA_PYTHON) + " " + TESSERA_SOURCE_DIR +
                                      "/tests/parity/lora_grad_reference.py --model " + dir + " --adapter " + adapter +
                                      " --alpha 8 --rank 4 --out " + out);
  ASSERT_EQ(r.code, 0) << r.out;
  const auto ref = io::SafetensorsFile::open(out);
  const auto base = io::SafetensorsFile::open(dir + "/reference.safetensors");
  const Tensor ids = base->get("input_ids").to(DType::kI32), targets = base->get("targets").to(DType::kI32);

  LoraWeights g = LoraWeights::zeros_like(w);
  m.set_lora(&w, &g);
  Params frozen = Params::allocate_frozen(c);
  const auto res = m.forward_backward(ids, targets, frozen);
  EXPECT_NEAR(res.loss, ref->get("loss").to_f32_vector()[0], 2e-5);
  EXPECT_LT(testing::relative_error(m.forward_batch(ids), ref->get("logits")), 2e-5);
  for (const auto& [name, t] : g.named(c))
    EXPECT_LT(testing::relative_error(t, ref->get("grad." + name)), 5e-5) << name;
  // The frozen base: no embedding, linear or head gradient exists to be written.
  EXPECT_FALSE(frozen.embed.defined());
  EXPECT_FALSE(frozen.layers[0].qkv.weight.defined());
  // Without adapters the model is the base again; with B = 0 (fresh adapters) too.
  m.set_lora(nullptr);
  const Tensor plain = m.forward_batch(ids);
  LoraWeights fresh = LoraWeights::init(c, config, 9);
  m.set_lora(&fresh);
  EXPECT_LT(testing::relative_error(m.forward_batch(ids), plain), 1e-6);
  fs::remove(adapter);
  fs::remove(out);
}

INSTANTIATE_TEST_SUITE_P(Families, LoraParity,
                         ::testing::Values("llama", "qwen2", "qwen3", "gemma2", "llama_mistral_window"),
                         [](const auto& info) { return info.param; });

TEST(Lora, DropoutBackwardMatchesFiniteDifferences) {
  const std::string dir = testing::parity_dir("llama");
  ASSERT_FALSE(dir.empty());
  Model m = Model::load(dir, DType::kF32);
  const auto& c = m.config();
  LoraConfig config = all_modules(4, 8);
  config.dropout = 0.3;
  LoraWeights w = testing::trained_lora(c, config, 3, 0.05f);
  LoraWeights g = LoraWeights::zeros_like(w);
  m.set_lora(&w, &g);
  m.set_lora_seed(77);
  const auto base = io::SafetensorsFile::open(dir + "/reference.safetensors");
  const Tensor ids = base->get("input_ids").to(DType::kI32), targets = base->get("targets").to(DType::kI32);
  Params frozen = Params::allocate_frozen(c);
  m.forward_backward(ids, targets, frozen);
  // d loss / d x for a few entries of A and B, by central differences of the same masked
  // forward (the mask depends only on the seed).
  const auto loss_at = [&] { return m.forward_backward(ids, targets, frozen).loss; };
  LoraWeights scratch = LoraWeights::zeros_like(w);
  m.set_lora(&w, &scratch);
  int checked = 0;
  for (auto [l, k, is_b, i] : std::vector<std::tuple<int, int, bool, int64_t>>{
           {0, 0, true, 3}, {0, 2, false, 17}, {1, 6, true, 5}, {1, 3, false, 40}, {0, 5, true, 11}}) {
    Tensor& t = is_b ? w.layers[l][k].b : w.layers[l][k].a;
    const Tensor& gt = is_b ? g.layers[l][k].b : g.layers[l][k].a;
    const float x0 = t.data<float>()[i], eps = 1e-2f;
    t.data<float>()[i] = x0 + eps;
    const double up = loss_at();
    t.data<float>()[i] = x0 - eps;
    const double down = loss_at();
    t.data<float>()[i] = x0;
    const double fd = (up - down) / (2 * eps), an = gt.data<float>()[i];
    EXPECT_NEAR(an, fd, 2e-3 + 2e-2 * std::abs(fd)) << "layer " << l << " module " << k << (is_b ? " B[" : " A[") << i << "]";
    ++checked;
  }
  EXPECT_EQ(checked, 5);
  // Dropout is on in training passes only: inference equals no-dropout adapters.
  LoraConfig no = config;
  no.dropout = 0;
  LoraWeights w0 = w;
  w0.config = no;
  const Tensor with = m.forward_batch(ids);
  m.set_lora(&w0);
  EXPECT_LT(testing::relative_error(with, m.forward_batch(ids)), 1e-6);
}

// The merged model (W + s B A, model/lora_io.h) computes what the base with the adapters
// attached computes: logits, and the KV-cached decode of the serving path.
TEST(Lora, MergedModelEqualsBasePlusAdapters) {
  for (const std::string arch : {"llama", "qwen2", "gemma2"}) {
    const std::string dir = testing::parity_dir(arch);
    ASSERT_FALSE(dir.empty());
    Model m = Model::load(dir, DType::kF32);
    LoraConfig config = all_modules(4, 8);
    config.rslora = arch == "qwen2";
    const LoraWeights w = testing::trained_lora(m.config(), config, 13, 0.05f);
    const auto base = io::SafetensorsFile::open(dir + "/reference.safetensors");
    const Tensor ids = base->get("input_ids").to(DType::kI32);
    m.set_lora(&w);
    const Tensor with = m.forward_batch(ids);
    model::KVCache cache = model::KVCache::create(m.config(), ids.size(1));
    const Tensor decoded = m.forward(testing::row(ids, 0), cache, /*all_logits=*/true);
    EXPECT_TRUE(testing::throws_error([&] { model::merge_lora(m, w); }, {"merge_lora", "attached"}, true));
    m.set_lora(nullptr);
    const Tensor plain = m.forward_batch(ids);
    Model merged = Model::load(dir, DType::kF32);
    model::merge_lora(merged, w);
    EXPECT_LT(testing::relative_error(merged.forward_batch(ids), with), 1e-5) << arch;
    EXPECT_GT(testing::relative_error(plain, with), 1e-3) << arch << ": the adapters changed nothing";
    model::KVCache cache2 = model::KVCache::create(merged.config(), ids.size(1));
    EXPECT_LT(testing::relative_error(merged.forward(testing::row(ids, 0), cache2, true), decoded), 1e-5) << arch;
  }
}

TEST(Lora, RefusesWhatItCannotAdapt) {
  const auto load = [](const std::string& arch) { return Model::load(testing::parity_dir(arch), DType::kF32); };
  const Model gpt2 = load("gpt2");
  EXPECT_TRUE(testing::throws_error([&] { LoraWeights::init(gpt2.config(), all_modules(4, 8), 1); }, {"gpt2", "c_attn"}, true));
  Model mixtral = load("mixtral");
  LoraConfig attn;
  attn.targets = {LoraModule::kQ};
  LoraWeights wm = LoraWeights::init(mixtral.config(), attn, 1);
  EXPECT_TRUE(testing::throws_error([&] { mixtral.set_lora(&wm); }, {"mixture-of-experts"}, true));
  Model llama = load("llama");
  LoraWeights wl = LoraWeights::init(llama.config(), attn, 1);
  wl.layers[0][0].b = Tensor::zeros({3, 3}, DType::kF32);
  EXPECT_TRUE(testing::throws_error([&] { llama.set_lora(&wl); }, {"layer 0", "q_proj"}, true));
  EXPECT_TRUE(model::parse_lora_module("q_proj").has_value());
  EXPECT_FALSE(model::parse_lora_module("qkv_proj").has_value());
}

}  // namespace
}  // namespace tessera

namespace tessera {
namespace {

// QLoRA: adapters over an int8 / int4 base train exactly as over the f32 model that holds
// the base's dequantized weights (an independent model: built from kernels::dequantize).
TEST(Lora, QuantizedBaseTrainsAsItsDequantizedFloatModel) {
  const std::string dir = testing::parity_dir("llama");
  ASSERT_FALSE(dir.empty());
  const auto base = io::SafetensorsFile::open(dir + "/reference.safetensors");
  const Tensor ids = base->get("input_ids").to(DType::kI32), targets = base->get("targets").to(DType::kI32);
  for (const std::string scheme : {"int8", "int4"}) {
    Model q = Model::load(dir, DType::kF32);
    model::quantize_model(q, model::quantize_options("rtn", scheme == "int8" ? 8 : 4, scheme == "int8" ? 0 : 32));
    ASSERT_TRUE(q.quantized());
    Model f = Model::load(dir, DType::kF32);  // the float model holding q's dequantized weights
    for (int64_t l = 0; l < f.config().num_layers; ++l)
      for (int which = 0; which < 4; ++which)
        f.weights().layers[l].linear(which).weight.copy_from(
            kernels::dequantize(*q.weights().layers[l].linear(which).quant));
    f.refresh_compute_weights();
    const LoraWeights w = testing::trained_lora(q.config(), all_modules(4, 8), 21, 0.05f);
    LoraWeights gq = LoraWeights::zeros_like(w), gf = LoraWeights::zeros_like(w);
    q.set_lora(&w, &gq);
    f.set_lora(&w, &gf);
    Params fq = Params::allocate_frozen(q.config()), ff = Params::allocate_frozen(f.config());
    const auto rq = q.forward_backward(ids, targets, fq), rf = f.forward_backward(ids, targets, ff);
    // Where the CPU multiplies bf16 natively faster (AMX), the quantized prompt GEMM runs on
    // bf16 operands (kernels/quant_cpu.cc) and the float model in f32: bf16's precision then
    // (as the QuantizedModel tests allow); elsewhere both are f32 products of the same weights.
    const bool bf16_gemm = kernels::bf16_native_gemm_faster();
    EXPECT_NEAR(rq.loss, rf.loss, bf16_gemm ? 5e-3 : 1e-4) << scheme;
    const auto nq = gq.named(q.config()), nf = gf.named(f.config());
    for (size_t i = 0; i < nq.size(); ++i)
      EXPECT_LT(testing::relative_error(nq[i].second, nf[i].second), bf16_gemm ? 5e-2 : 1e-3)
          << scheme << " " << nq[i].first;
  }
}

}  // namespace
}  // namespace tessera
