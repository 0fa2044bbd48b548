// LoRA fine-tuning runs: the loss falls with the base frozen (its weights bit-equal after
// training), a resumed run continues bit-identically, two data-parallel ranks follow one
// process, the memory saved is what lora_memory predicts (measured against a full
// fine-tuning run of the same model), packed chat data trains, and bad [lora] tables are
// one-line errors.
#include <gtest/gtest.h>

#include "tessera/io/safetensors.h"
#include "tessera/model/lora_io.h"
#include "tessera/model/model.h"
#include "tessera/train/chat_data.h"
#include "tessera/train/data_loader.h"
#include "tessera/train/lora_trainer.h"
#include "test_util/throws.h"
#include "trainer_test_util.h"

namespace tessera::train {
namespace {

// A base model to fine-tune: a tiny llama pre-trained briefly on the synthetic corpus (a
// random model's features give the adapters little to work with).
std::string make_base(const std::string& root) {
  const std::string data = fs::exists(root + "/data") ? root + "/data" : make_data(root);
  return run_training(TrainConfig::parse(base_config(root + "/pre", data, 30), "pre.toml")).model_dir;
}

const std::string kLora = "rank = 8\nalpha = 16\ntarget_modules = [\"q_proj\", \"v_proj\", \"o_proj\", \"down_proj\"]\n";

double last4(const std::vector<double>& v) { return (v[v.size() - 1] + v[v.size() - 2] + v[v.size() - 3] + v[v.size() - 4]) / 4; }

std::string lora_config(const std::string& out, const std::string& data, const std::string& base, int64_t steps,
                        const std::string& lora = kLora,
                        const std::string& precision = "fp32", const std::string& lr = "0.003") {
  return "[run]\nout_dir = \"" + out + "\"\n[model]\ninit_from = \"" + base + "\"\n" +
         "[data]\ndir = \"" + data + "\"\nseq_len = 32\nbatch_size = 4\n" +
         "[optimizer]\nlr = " + lr + "\n[training]\nsteps = " + std::to_string(steps) + "\nprecision = \"" + precision +
         "\"\neval_batches = 2\n[checkpoint]\nevery = 4\n" +
         "[logging]\nprogress = false\npeak_gflops = 100.0\nplot = false\n[lora]\n" + lora;
}

TEST(LoraTraining, LearnsWithTheBaseFrozenAndResumesBitIdentically) {
  const std::string root = temp_dir("lora_resume");
  const std::string data = make_data(root), base = make_base(root);
  const RunOut full = train(lora_config(root + "/a", data, base, 12), 0);
  ASSERT_EQ(full.losses.size(), 12u);
  // Against the same batches with the adapters held still (lr ~ 0): the trained ones do better.
  const RunOut still = train(lora_config(root + "/z", data, base, 12, kLora, "fp32", "1e-9"), 0);
  EXPECT_LT(last4(full.losses), last4(still.losses) - 0.02) << "the adapters learned nothing";
  // The base is untouched: the adapter directory holds only adapters, and they moved.
  const auto adapter = model::load_peft_adapter(root + "/a/adapter", model::ModelConfig::load(base));
  EXPECT_EQ(adapter.config.rank, 8);
  double moved = 0;
  for (const auto& layer : adapter.layers)
    for (const auto& p : layer)
      if (p.b.defined())
        for (float x : p.b.to_f32_vector()) moved = std::max(moved, static_cast<double>(std::abs(x)));
  EXPECT_GT(moved, 1e-3);
  // Stopped after step 6 (a checkpoint at 4), resumed: the same losses, bit for bit.
  TrainOptions stop;
  stop.stop_after = 6;
  train(lora_config(root + "/b", data, base, 12), 0, stop);
  TrainOptions resume;
  resume.resume = true;
  const RunOut second = train(lora_config(root + "/b", data, base, 12), 0, resume);
  ASSERT_EQ(second.losses.size(), 8u);  // steps 5..12
  for (size_t i = 0; i < 8; ++i) EXPECT_EQ(second.losses[i], full.losses[4 + i]) << "step " << 5 + i;
  fs::remove_all(root);
}

TEST(LoraTraining, TwoDataParallelRanksFollowOneProcess) {
  const std::string root = temp_dir("lora_ddp");
  const std::string data = make_data(root), base = make_base(root);
  const RunOut one = train(lora_config(root + "/one", data, base, 6), 0);
  const RunOut two = train(lora_config(root + "/two", data, base, 6), 2);
  expect_close(two.losses, one.losses, 1e-5, "loss");
  expect_close(two.grad_norms, one.grad_norms, 1e-4, "grad_norm");
  fs::remove_all(root);
}

TEST(LoraTraining, SavesTheMemoryItPredicts) {
  const std::string root = temp_dir("lora_memory");
  const std::string data = make_data(root), base = make_base(root);
  const std::string lora = "rank = 8\nalpha = 16\ntarget_modules = [\"all-linear\"]\n";
  const RunOut lr = train(lora_config(root + "/lora", data, base, 2, lora, "bf16"), 0);
  // Full fine-tuning of the same model and batch (no [lora]).
  std::string full_cfg = lora_config(root + "/full", data, base, 2, "", "bf16");
  full_cfg = full_cfg.substr(0, full_cfg.rfind("[lora]"));
  const RunOut fu = train(full_cfg, 0);
  const auto state_bytes = [](const nlohmann::json& r) {
    return r.at("mem_grads").get<int64_t>() + r.at("mem_optimizer").get<int64_t>();
  };
  const TrainConfig c = TrainConfig::parse(lora_config(root + "/x", data, base, 2, lora, "bf16"), "t");
  const model::Model m = model::Model::load(base);
  const auto w = model::LoraWeights::init(m.config(), lora_config(c.lora), 1);
  const LoraMemory predicted = lora_memory(m, w, c);
  EXPECT_EQ(state_bytes(lr.records.back()), predicted.lora_bytes);
  EXPECT_EQ(state_bytes(fu.records.back()), predicted.full_bytes);
  EXPECT_GT(predicted.full_bytes, 5 * predicted.lora_bytes);
  // The same activations either way (the adapters' are not kept), the same weights held.
  EXPECT_EQ(lr.records.back().at("mem_params"), fu.records.back().at("mem_params"));
  fs::remove_all(root);
}

TEST(LoraTraining, TrainsOnPackedChatData) {
  const std::string root = temp_dir("lora_chat");
  const std::string base = make_base(root), data = root + "/chat";
  std::vector<ChatDocument> docs;
  std::mt19937 rng(3);
  for (int i = 0; i < 64; ++i) {  // "prompt" tokens 100.., then an answer the prompt determines
    ChatDocument d;
    const int32_t key = static_cast<int32_t>(rng() % 20);
    for (int t = 0; t < 4; ++t) d.tokens.push_back(100 + key), d.mask.push_back(0);
    for (int t = 0; t < 5; ++t) d.tokens.push_back(10 + (key * 7 + t) % 50), d.mask.push_back(1);
    docs.push_back(d);
  }
  ChatDataMeta meta;
  meta.vocab_size = 256;
  write_chat_data(data, meta, docs, {docs.begin(), docs.begin() + 8});
  const RunOut r = train(lora_config(root + "/run", data, base, 15, kLora, "fp32", "0.01"), 0);
  const RunOut still = train(lora_config(root + "/still", data, base, 15, kLora, "fp32", "1e-9"), 0);
  EXPECT_LT(last4(r.losses), last4(still.losses) - 0.2);
  EXPECT_GT(r.val_loss, 0);
  fs::remove_all(root);
}

TEST(LoraTraining, QuantizedBaseTrains) {
  const std::string root = temp_dir("lora_qlora");
  const std::string data = make_data(root), base = make_base(root);
  const RunOut q = train(lora_config(root + "/q", data, base, 3, kLora + "quantize_base = \"int8\"\n"), 0);
  const RunOut f = train(lora_config(root + "/f", data, base, 3), 0);
  ASSERT_EQ(q.losses.size(), 3u);
  EXPECT_NEAR(q.losses[0], f.losses[0], 0.05);  // int8 weights: nearly the float model's loss
  EXPECT_LT(q.records.back().at("mem_params").get<int64_t>(), f.records.back().at("mem_params").get<int64_t>());
  EXPECT_TRUE(testing::throws_error(
      [&] { TrainConfig::parse(lora_config(root + "/r", data, base, 2, "quantize_base = \"nf4\"\n"), "t.toml"); },
      {"lora.quantize_base", "nf4"}, true));
  fs::remove_all(root);
}

TEST(LoraTraining, BadTablesAreOneLineErrors) {
  const std::string root = temp_dir("lora_bad");
  const std::string data = make_data(root), base = make_base(root);
  EXPECT_TRUE(testing::throws_error(
      [&] { TrainConfig::parse(lora_config(root + "/r", data, base, 2, "target_modules = [\"qkv\"]\n"), "t.toml"); },
      {"t.toml", "lora.target_modules", "qkv"}, true));
  EXPECT_TRUE(testing::throws_error(
      [&] { TrainConfig::parse(lora_config(root + "/r", data, base, 2, "rank = 0\n"), "t.toml"); }, {"lora.rank"}, true));
  EXPECT_TRUE(testing::throws_error(
      [&] { TrainConfig::parse(lora_config(root + "/r", data, base, 2, "dropout = 1.0\n"), "t.toml"); },
      {"lora.dropout"}, true));
  std::string no_base = lora_config(root + "/r", data, base, 2);
  no_base.replace(no_base.find("init_from"), 9, "shape = \"tiny\"\n#");
  EXPECT_TRUE(testing::throws_error([&] { TrainConfig::parse(no_base, "t.toml"); }, {"model.init_from"}, true));
  const TrainConfig tp = TrainConfig::parse(lora_config(root + "/r", data, base, 2) + "[parallel]\ntp = 2\n", "t.toml");
  EXPECT_TRUE(testing::throws_error([&] { run_training(tp); }, {"[lora]", "tensor"}, true));
  const TrainConfig f16 = TrainConfig::parse(lora_config(root + "/r", data, base, 2, "rank = 2\n", "fp16"), "t.toml");
  EXPECT_TRUE(testing::throws_error([&] { run_training(f16); }, {"fp16"}, true));
  fs::remove_all(root);
}

}  // namespace
}  // namespace tessera::train
