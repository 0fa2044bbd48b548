// Quantized models: a model whose block linears are quantized computes the logits of the
// float model holding the dequantized weights (the product is only the weights' storage,
// not a different model), stays close to the float original, and saves as an AutoGPTQ
// checkpoint that loads back to identical logits. Training and tensor parallelism refuse
// quantized weights with one line.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <random>

#include "tessera/io/json_file.h"
#include "tessera/kernels/bf16_speed.h"
#include "tessera/model/calibrated_quant.h"
#include "tessera/model/model.h"
#include "tessera/model/quantize.h"
#include "test_util/run_command.h"
#include "test_util/tensor_diff.h"

namespace tessera {
namespace {

namespace fs = std::filesystem;

std::vector<int32_t> prompt() { return {1, 5, 9, 33, 2, 77, 100, 3, 4, 200, 17, 8}; }

Tensor logits_of(const model::Model& m) {
  auto cache = model::KVCache::create(m.config(), 32);
  return m.forward(prompt(), cache, true);
}

using tessera::testing::max_abs;
using tessera::testing::max_abs_diff;

struct Case {
  const char* scheme;
  int64_t group;
  float rel_tol_vs_float;  // logits against the unquantized model, relative to their range
};

TEST(QuantizedModel, ComputesTheDequantizedModelAndStaysNearTheFloatOne) {
  const auto c = model::ModelConfig::named_shape("tiny");
  const model::Model ref = model::Model::random(c, DType::kF32, 3);
  const Tensor want = logits_of(ref);
  for (const Case& k : {Case{"int8", 0, 0.02f}, Case{"int4", 32, 0.15f}, Case{"fp8", 0, 0.08f},
                        Case{"w8a8", 0, 0.04f}}) {
    model::Model q = model::Model::random(c, DType::kF32, 3);
    auto o = model::quantize_options_for_scheme(k.scheme);
    o.group_size = k.group;
    model::quantize_model(q, o);
    ASSERT_TRUE(q.quantized());
    const Tensor got = logits_of(q);
    // The float model with every block linear replaced by its dequantized weights.
    model::Model d = model::Model::random(c, DType::kF32, 3);
    for (int64_t l = 0; l < c.num_layers; ++l)
      for (int w = 0; w < 4; ++w)
        d.weights().layers[l].linear(w).weight.copy_from(
            kernels::dequantize(*q.weights().layers[l].linear(w).quant));
    const Tensor dense = logits_of(d);
    const float range = max_abs(want);
    // w8a8 also rounds the activations to int8, so it is compared at that precision; where
    // the CPU multiplies bf16 natively faster (AMX), the prompt's blocked GEMM runs on bf16
    // operands (x and the dequantized rows), at bf16's precision.
    const float dense_tol = std::string(k.scheme) == "w8a8"     ? 0.03f * range
                            : kernels::bf16_native_gemm_faster() ? 1e-2f * range
                                                                 : 2e-4f * range;
    EXPECT_LT(max_abs_diff(got, dense), dense_tol) << k.scheme;
    EXPECT_LT(max_abs_diff(got, want), k.rel_tol_vs_float * range) << k.scheme;
    EXPECT_GT(max_abs_diff(got, want), 0.f) << k.scheme << ": quantization changed nothing";
    EXPECT_LT(q.matmul_weight_bytes(), ref.matmul_weight_bytes()) << k.scheme;
  }
}

TEST(QuantizedModel, SavesAsAutoGptqAndLoadsBackToIdenticalLogits) {
  const auto c = model::ModelConfig::named_shape("tiny");
  for (int bits : {8, 4}) {
    const std::string dir = (fs::temp_directory_path() /
                             ("tessera_qmodel_" + std::to_string(::getpid()) + "_" + std::to_string(bits)))
                                .string();
    fs::remove_all(dir);
    model::Model q = model::Model::random(c, DType::kF32, 4);
    model::quantize_model(q, model::quantize_options("rtn", bits, bits == 4 ? 64 : 0));
    q.save(dir);
    const auto cfg = io::read_json_file(dir + "/config.json");
    const auto& qc = cfg.at("quantization_config");
    EXPECT_EQ(qc.at("quant_method"), "gptq");
    EXPECT_EQ(qc.at("bits"), bits);
    EXPECT_EQ(qc.at("group_size"), bits == 4 ? 64 : -1);
    const model::Model back = model::Model::load(dir);
    ASSERT_TRUE(back.quantized());
    EXPECT_EQ(max_abs_diff(logits_of(back), logits_of(q)), 0.f) << bits;
    EXPECT_EQ(back.weights_description(), q.weights_description());
    // Training and tensor-parallel splits refuse quantized weights, in one line.
    EXPECT_THROW(back.shard(model::TpShard{0, 2}), std::exception);
    try {
      model::Model::load(dir, DType::kF32, model::TpShard{0, 2});
      ADD_FAILURE() << "a tp shard of a quantized checkpoint loaded";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("quantized"), std::string::npos) << e.what();
    }
    fs::remove_all(dir);
  }
}

// fp8 weights save as llm-compressor's compressed-tensors "float-quantized" (vLLM's FP8
// scheme), per channel or per group. An independent NumPy reader
// (tests/parity/fp8_checkpoint_reference.py) checks the config, decodes every F8_E4M3
// weight within fp8's rounding of the float weight it came from, and writes the float model
// those values make: it gives the logits the fp8 model computes.
TEST(QuantizedModel, Fp8SavesAsCompressedTensorsThatAnIndependentReaderDecodes) {
  const auto c = model::ModelConfig::named_shape("tiny");
  const std::string root = (fs::temp_directory_path() / ("tessera_qfp8_" + std::to_string(::getpid()))).string();
  for (int64_t group : {int64_t{-1}, int64_t{32}}) {
    SCOPED_TRACE("group " + std::to_string(group));
    fs::remove_all(root);
    const model::Model f = model::Model::random(c, DType::kF32, 8);
    f.save(root + "/float");
    model::Model q = model::Model::load(root + "/float");
    model::quantize_model(q, model::quantize_options("rtn", 8, group, "fp8"));
    q.save(root + "/fp8");
    const auto qc = io::read_json_file(root + "/fp8/config.json").at("quantization_config");
    EXPECT_EQ(qc.at("format"), "float-quantized");
    const auto r = tessera::testing::run_command(std::string(TESSERA_PYTHON) + " " + TESSERA_SOURCE_DIR +
                                                 "/tests/parity/fp8_checkpoint_reference.py " + root + "/float " +
                                                 root + "/fp8 " + root + "/ref");
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_EQ(r.out.rfind("ok " + std::to_string(7 * c.num_layers), 0), 0u) << r.out;
    const model::Model back = model::Model::load(root + "/fp8");
    ASSERT_TRUE(back.quantized());
    EXPECT_NE(back.weights_description().find("fp8"), std::string::npos) << back.weights_description();
    EXPECT_EQ(max_abs_diff(logits_of(back), logits_of(q)), 0.f);
    const Tensor want = logits_of(model::Model::load(root + "/ref"));
    const float tol = (kernels::bf16_native_gemm_faster() ? 1e-2f : 2e-4f) * max_abs(want);
    EXPECT_LT(max_abs_diff(logits_of(back), want), tol);
  }
  fs::remove_all(root);
}

Tensor random_ids(int64_t B, int64_t T, int64_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  Tensor t = Tensor::empty({B, T}, DType::kI32);
  for (int64_t i = 0; i < B * T; ++i) t.data<int32_t>()[i] = static_cast<int32_t>(rng() % vocab);
  return t;
}

// Mean squared difference of two models' logits over held-out windows.
double logit_mse(const model::Model& a, const model::Model& b, const Tensor& ids) {
  const Tensor la = a.forward_batch(ids), lb = b.forward_batch(ids);
  double s = 0;
  for (int64_t i = 0; i < la.numel(); ++i) {
    const double d = la.data<float>()[i] - lb.data<float>()[i];
    s += d * d;
  }
  return s / static_cast<double>(la.numel());
}

TEST(QuantizedModel, GptqCalibratedLayerByLayerBeatsRoundToNearestAndSaves) {
  // GPTQ run over the whole model on calibration windows (each layer fed what the
  // quantized layers before it produce) against round-to-nearest at the same bits and
  // groups: closer logits to the float model on held-out windows of the same text.
  const auto c = model::ModelConfig::named_shape("tiny");
  const model::Model ref = model::Model::random(c, DType::kF32, 6);
  const Tensor calib = random_ids(16, 32, c.vocab_size, 1), held_out = random_ids(8, 32, c.vocab_size, 2);
  model::Model rtn = model::Model::random(c, DType::kF32, 6);
  model::quantize_model(rtn, model::quantize_options("rtn", 4, 32));
  const double e_rtn = logit_mse(ref, rtn, held_out);
  for (bool act_order : {false, true}) {
    SCOPED_TRACE(act_order ? "act-order" : "in order");
    model::Model g = model::Model::random(c, DType::kF32, 6);
    auto o = model::quantize_options("gptq", 4, 32);
    o.act_order = act_order;
    int64_t layers_done = 0;
    model::quantize_model(g, o, calib, [&](int64_t done, int64_t) { layers_done = done; });
    EXPECT_EQ(layers_done, c.num_layers);
    ASSERT_TRUE(g.quantized());
    EXPECT_NE(g.weights_description().find("(gptq)"), std::string::npos) << g.weights_description();
    const double e_gptq = logit_mse(ref, g, held_out);
    std::printf("logit MSE vs float on held-out windows: gptq%s %.3e, rtn %.3e\n",
                act_order ? " act-order" : "", e_gptq, e_rtn);
    EXPECT_LT(e_gptq, 0.8 * e_rtn);
    // Saved as AutoGPTQ (desc_act and g_idx with act-order) and loaded back: the same logits.
    const std::string dir = (fs::temp_directory_path() /
                             ("tessera_qgptq_" + std::to_string(::getpid()) + (act_order ? "_ao" : "")))
                                .string();
    fs::remove_all(dir);
    g.save(dir);
    const auto cfg = io::read_json_file(dir + "/config.json");
    EXPECT_EQ(cfg.at("quantization_config").at("desc_act"), act_order);
    const model::Model back = model::Model::load(dir);
    // (With act-order, g_idx records each column's group, not the order inside it: the
    // loaded weight sums a group's columns in another order, the same values.)
    const Tensor lg = logits_of(g);
    EXPECT_LE(max_abs_diff(logits_of(back), lg), act_order ? 1e-5f * max_abs(lg) : 0.f);
    fs::remove_all(dir);
  }
  // Calibration is required.
  model::Model none = model::Model::random(c, DType::kF32, 6);
  EXPECT_THROW(model::quantize_model(none, model::quantize_options("gptq", 4, 32)), std::exception);
}

// tiny's shape with every query head its own key-value head, or as GPT-2 (LayerNorm with
// biases, Conv1D weights stored (in, out), a GELU MLP: down's input does not fold).
model::ModelConfig tiny_variant(const std::string& which) {
  auto c = model::ModelConfig::named_shape("tiny");
  if (which == "mha") c.num_kv_heads = c.num_heads;
  if (which == "gpt2") {
    c.arch = model::Arch::kGpt2, c.model_type = "gpt2";
    c.num_kv_heads = c.num_heads;
    c.tie_word_embeddings = true;
  }
  return c;
}

TEST(QuantizedModel, InputScalesFoldIntoThePreviousOperationsExactly) {
  // AWQ and SmoothQuant multiply a linear's input columns by s and divide what produces
  // the input by s: norm weights and biases, v's rows (no GQA), up's rows (gated MLP).
  // In f32 the model must compute the same logits.
  for (const std::string variant : {"gqa", "mha", "gpt2"}) {
    SCOPED_TRACE(variant);
    const auto c = tiny_variant(variant);
    model::Model m = model::Model::random(c, DType::kF32, 11);
    const Tensor before = logits_of(m);
    std::mt19937 rng(12);
    std::uniform_real_distribution<float> u(0.25f, 4.f);
    int folded = 0;
    for (int64_t l = 0; l < c.num_layers; ++l) {
      model::LayerScales sc;
      for (int which = 0; which < 4; ++which) {
        const int64_t in = which == 0 || which == 2 ? c.hidden_size : which == 1 ? c.q_dim() : c.intermediate_size;
        if (!model::input_scale_foldable(c, which)) {
          sc.s[which].assign(in, 2.f);
          model::LayerScales bad;
          bad.s[which] = sc.s[which];
          EXPECT_THROW(model::scale_layer_inputs(m, l, bad), std::exception);
          sc.s[which].clear();
          continue;
        }
        for (int64_t j = 0; j < in; ++j) sc.s[which].push_back(u(rng));
        ++folded;
      }
      model::scale_layer_inputs(m, l, sc);
    }
    EXPECT_EQ(folded, c.num_layers * (variant == "mha" ? 4 : 3));
    const Tensor after = logits_of(m);
    EXPECT_LE(max_abs_diff(after, before), 2e-5f * max_abs(before));
  }
}

// A random model whose norms give a few channels 12x the others' magnitude (as trained
// LLMs' activations have): what AWQ and SmoothQuant are for.
model::Model outlier_model(const model::ModelConfig& c) {
  model::Model m = model::Model::random(c, DType::kF32, 21);
  for (auto& L : m.weights().layers)
    for (Tensor* t : {&L.norm1_w, &L.norm2_w})
      for (int64_t j : {3, 17, 40}) t->data<float>()[j] *= 12.f;
  return m;
}

TEST(QuantizedModel, AwqAndSmoothQuantBeatRoundToNearestOnOutlierChannels) {
  for (const std::string variant : {"mha", "gqa", "gpt2"}) {
    SCOPED_TRACE(variant);
    const auto c = tiny_variant(variant);
    const model::Model ref = outlier_model(c);
    const Tensor calib = random_ids(16, 32, c.vocab_size, 3), held_out = random_ids(8, 32, c.vocab_size, 4);
    model::Model rtn = outlier_model(c);
    model::quantize_model(rtn, model::quantize_options("rtn", 4, 32));
    model::Model awq = outlier_model(c);
    int64_t layers_done = 0;
    model::quantize_model(awq, model::quantize_options("awq", 4, 32), calib,
                          [&](int64_t done, int64_t) { layers_done = done; });
    EXPECT_EQ(layers_done, c.num_layers);
    EXPECT_NE(awq.weights_description().find("int4 g32 (awq)"), std::string::npos) << awq.weights_description();
    const double e_rtn = logit_mse(ref, rtn, held_out), e_awq = logit_mse(ref, awq, held_out);
    model::Model w8a8 = outlier_model(c);
    model::quantize_model(w8a8, model::quantize_options_for_scheme("w8a8"));
    model::Model sq = outlier_model(c);
    model::quantize_model(sq, model::quantize_options("smoothquant", 8, 0), calib);
    EXPECT_NE(sq.weights_description().find("w8a8"), std::string::npos) << sq.weights_description();
    const double e_w8a8 = logit_mse(ref, w8a8, held_out), e_sq = logit_mse(ref, sq, held_out);
    std::printf("%s logit MSE vs float: int4 g32 rtn %.3e awq %.3e (%.2fx); w8a8 rtn %.3e smoothquant %.3e (%.2fx)\n",
                variant.c_str(), e_rtn, e_awq, e_awq / e_rtn, e_w8a8, e_sq, e_sq / e_w8a8);
    EXPECT_LT(e_awq, 0.8 * e_rtn);
    EXPECT_LT(e_sq, 0.8 * e_w8a8);
    // AutoAWQ's block objective (--awq-inspect-tokens): q/k/v and gate/up scored on the
    // layer's output over the first 4 windows; it beats RTN too, and each candidate it
    // tried left the layer as it was (the float weights are back before the scales fold).
    model::Model awq_block = outlier_model(c);
    auto block_opts = model::quantize_options("awq", 4, 32);
    block_opts.awq_inspect_tokens = 100;  // (rounded up to whole windows of 32: 4)
    model::quantize_model(awq_block, block_opts, calib);
    const double e_block = logit_mse(ref, awq_block, held_out);
    std::printf("%s int4 g32 awq scored on the layer output: logit MSE %.3e (%.2fx rtn)\n", variant.c_str(),
                e_block, e_block / e_rtn);
    EXPECT_LT(e_block, 0.8 * e_rtn);
    // --awq-clip-qk: the clip search runs on q and k too. It changes the model (AutoAWQ's
    // default leaves q and k unclipped) and still beats RTN.
    auto clip_opts = model::quantize_options("awq", 4, 32);
    clip_opts.awq_clip_qk = true;
    model::Model awq_clip = outlier_model(c);
    model::quantize_model(awq_clip, clip_opts, calib);
    const double e_clip = logit_mse(ref, awq_clip, held_out);
    std::printf("%s int4 g32 awq with q/k clipped: logit MSE %.3e (%.2fx rtn)\n", variant.c_str(), e_clip,
                e_clip / e_rtn);
    EXPECT_GT(max_abs_diff(logits_of(awq_clip), logits_of(awq)), 0.f);
    EXPECT_LT(e_clip, 0.8 * e_rtn);
    if (variant == "mha") {
      block_opts.awq_inspect_tokens = -1;
      model::Model bad = outlier_model(c);
      EXPECT_THROW(model::quantize_model(bad, block_opts, calib), std::exception);
    }
    // AWQ saves as an AutoAWQ checkpoint and loads back to the same logits.
    const std::string dir =
        (fs::temp_directory_path() / ("tessera_qawq_" + std::to_string(::getpid()) + variant)).string();
    fs::remove_all(dir);
    awq.save(dir);
    const auto qc = io::read_json_file(dir + "/config.json").at("quantization_config");
    EXPECT_EQ(qc.at("quant_method"), "awq");
    EXPECT_EQ(qc.at("version"), "gemm");
    EXPECT_EQ(qc.at("group_size"), 32);
    const model::Model back = model::Model::load(dir);
    EXPECT_EQ(max_abs_diff(logits_of(back), logits_of(awq)), 0.f);
    // SmoothQuant saves as llm-compressor's compressed-tensors W8A8 (int8 weights, int8
    // per-token dynamic activations) and loads back to the same logits.
    fs::remove_all(dir);
    sq.save(dir);
    const auto ct = io::read_json_file(dir + "/config.json").at("quantization_config");
    EXPECT_EQ(ct.at("quant_method"), "compressed-tensors");
    EXPECT_EQ(ct.at("format"), "int-quantized");
    EXPECT_EQ(ct.at("config_groups").at("group_0").at("input_activations").at("strategy"), "token");
    const model::Model sq_back = model::Model::load(dir);
    EXPECT_NE(sq_back.weights_description().find("w8a8 (smoothquant)"), std::string::npos)
        << sq_back.weights_description();
    EXPECT_EQ(max_abs_diff(logits_of(sq_back), logits_of(sq)), 0.f);
    fs::remove_all(dir);
  }
}

TEST(QuantizedModel, OptionsRejectWhatTheFormatsCannotHold) {
  EXPECT_THROW(model::quantize_options("awq", 8, 0), std::exception);
  EXPECT_THROW(model::quantize_options("awq", 4, -1), std::exception);
  EXPECT_THROW(model::quantize_options("smoothquant", 4, 0), std::exception);
  EXPECT_THROW(model::quantize_options("rtn", 3, 0), std::exception);
  EXPECT_THROW(model::quantize_options("rtn", 4, 48), std::exception);
  EXPECT_THROW(model::quantize_options("magic", 4, 0), std::exception);
  model::Model m = model::Model::random(model::ModelConfig::named_shape("tiny"), DType::kF32, 1);
  // tiny has 64 hidden features: group 128 does not divide them.
  EXPECT_THROW(model::quantize_model(m, model::quantize_options("rtn", 4, 128)), std::exception);
  EXPECT_THROW(model::quantize_model(m, model::quantize_options("gptq", 4, 32)), std::exception);
}

// Calibration windows cover the whole text, evenly and without overlap: window i starts
// at round-down(i (n - seq) / (windows - 1)), the last ends the text; a text shorter than
// samples x seq gives as many whole windows as fit, and one shorter than a window is an
// error naming the file.
TEST(QuantizedModel, CalibrationWindowsSpreadEvenlyOverTheText) {
  std::vector<int32_t> ids(1000);
  for (int32_t i = 0; i < 1000; ++i) ids[i] = i;
  const Tensor t = model::calibration_windows(ids, 4, 100, "--calib x.txt");
  ASSERT_EQ(t.size(0), 4);
  ASSERT_EQ(t.size(1), 100);
  const int32_t starts[4] = {0, 300, 600, 900};
  for (int64_t w = 0; w < 4; ++w)
    for (int64_t j = 0; j < 100; ++j) ASSERT_EQ(t.data<int32_t>()[w * 100 + j], starts[w] + j) << w << " " << j;

  const Tensor few = model::calibration_windows(ids, 64, 300, "--calib x.txt");  // 3 fit
  ASSERT_EQ(few.size(0), 3);
  EXPECT_EQ(few.data<int32_t>()[0], 0);
  EXPECT_EQ(few.data<int32_t>()[300], 350);  // 1 x (1000 - 300) / 2
  EXPECT_EQ(few.data<int32_t>()[600 + 299], 999);

  const Tensor one = model::calibration_windows(ids, 1, 50, "--calib x.txt");
  ASSERT_EQ(one.size(0), 1);
  EXPECT_EQ(one.data<int32_t>()[49], 49);
  try {
    model::calibration_windows(std::vector<int32_t>(10, 1), 4, 256, "--calib short.txt");
    FAIL() << "a text shorter than one window was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("--calib short.txt: 10 tokens"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace tessera
