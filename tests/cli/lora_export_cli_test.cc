// `tessera export --merge-lora ADAPTER --model BASE --out DIR` end to end: the directory
// loads with the adapter merged into its weights (merge_lora's values exactly), carries the
// base's tokenizer files, and generates; flag combinations that cannot work are one-line
// errors that write nothing.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "tessera/io/json_file.h"
#include "tessera/io/tokenizer.h"
#include "tessera/model/lora_io.h"
#include "tessera/model/model.h"
#include "test_util/run_command.h"

namespace tessera {
namespace {

namespace fs = std::filesystem;
using testing::run_cli;

class LoraExportCli : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() / ("tessera_lora_cli_" + std::to_string(::getpid()));
    fs::remove_all(root_);
    fs::create_directories(root_);
    const std::string corpus = file("corpus.txt");
    {
      std::ofstream out(corpus);
      for (int i = 0; i < 20; ++i) out << "The quick brown fox jumps over the lazy dog. Hello world!\n";
    }
    io::BpeTrainOptions bo;
    bo.vocab_size = 300;
    bo.special_tokens = {"<|endoftext|>"};
    bo.progress = false;
    const io::Tokenizer tok = io::train_bpe({corpus}, bo);
    config_ = model::ModelConfig::named_shape("tiny");
    config_.vocab_size = tok.vocab_size();
    config_.eos_token_id = tok.eos_id();
    config_.bos_token_id = -1;
    model::Model::random(config_, DType::kF32, 31).save(file("base"));
    tok.save(file("base"));
    std::ofstream(file("base/special_tokens_map.json")) << R"({"eos_token": "<|endoftext|>"})";
    std::ofstream(file("base/chat_template.jinja")) << "{% for m in messages %}{{ m.content }}{% endfor %}";

    model::LoraConfig lc;
    lc.rank = 4;
    lc.alpha = 8;
    for (int i = 0; i < model::kLoraModules; ++i) lc.targets.push_back(static_cast<model::LoraModule>(i));
    adapter_ = model::LoraWeights::init(config_, lc, 5);
    for (auto& layer : adapter_.layers)  // B drawn too: at init it is 0 and merging is a no-op
      for (auto& p : layer)
        for (int64_t i = 0; i < p.b.numel(); ++i) p.b.data<float>()[i] = 0.01f * static_cast<float>((i * 37) % 11 - 5);
    model::save_peft_adapter(file("adapter"), config_, adapter_, file("base"));
  }
  void TearDown() override { fs::remove_all(root_); }
  std::string file(const std::string& n) const { return (root_ / n).string(); }

  fs::path root_;
  model::ModelConfig config_;
  model::LoraWeights adapter_;
};

TEST_F(LoraExportCli, WritesTheMergedModelWithTheBaseTokenizer) {
  const auto r = run_cli("export --merge-lora " + file("adapter") + " --model " + file("base") + " --out " + file("out"));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << r.out;
  EXPECT_NE(r.out.find("wrote " + file("out") + ": "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("(14 modules, r 4, alpha 8)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("model.safetensors, tokenizer.json, tokenizer_config.json, special_tokens_map.json, "
                       "chat_template.jinja"),
            std::string::npos)
      << r.out;

  model::Model want = model::Model::load(file("base"));
  const model::Model base = model::Model::load(file("base"));
  model::merge_lora(want, adapter_);
  const model::Model got = model::Model::load(file("out"));
  EXPECT_EQ(got.config().to_json(), want.config().to_json());
  const auto g = got.weights().named(config_), w = want.weights().named(config_), b = base.weights().named(config_);
  ASSERT_EQ(g.size(), w.size());
  int changed = 0;
  for (size_t i = 0; i < w.size(); ++i) {
    ASSERT_EQ(g[i].first, w[i].first);
    const auto gv = g[i].second.to_f32_vector(), wv = w[i].second.to_f32_vector(), bv = b[i].second.to_f32_vector();
    ASSERT_EQ(gv, wv) << w[i].first;
    changed += gv != bv;
  }
  EXPECT_EQ(changed, 2 * 7) << "every layer's q, k, v, o, gate, up, down moved; nothing else";
  // q_proj: the base rows plus 2 B A (scale alpha / r = 2), checked element by element.
  const Tensor q = got.weights().layers[1].qkv.weight, q0 = base.weights().layers[1].qkv.weight;
  const auto& p = adapter_.layers[1][0];
  for (int64_t row : {int64_t{0}, int64_t{63}})
    for (int64_t col : {int64_t{0}, int64_t{17}}) {
      double d = 0;
      for (int64_t k = 0; k < 4; ++k)
        d += static_cast<double>(p.b.data<float>()[row * 4 + k]) * p.a.data<float>()[k * 64 + col];
      EXPECT_NEAR(q.data<float>()[row * 64 + col], q0.data<float>()[row * 64 + col] + 2 * d, 1e-6) << row << " " << col;
    }

  for (const char* name : {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"})
    EXPECT_EQ(io::read_file_bytes(file("out/") + name), io::read_file_bytes(file("base/") + name)) << name;
  EXPECT_TRUE(fs::exists(file("out/generation_config.json")));
  const auto gen = run_cli("generate --model " + file("out") + " --prompt 'Hello world' --max-tokens 4");
  EXPECT_EQ(gen.code, 0) << gen.out;

  // An f32 GGUF file as the base: the same merged weights, its tokenizer written out.
  ASSERT_EQ(run_cli("export --format gguf --type f32 --model " + file("base") + " --out " + file("base.gguf")).code, 0);
  const auto rg =
      run_cli("export --merge-lora " + file("adapter") + " --model " + file("base.gguf") + " --out " + file("out2"));
  ASSERT_EQ(rg.code, 0) << rg.out;
  EXPECT_NE(rg.out.find("(14 modules, r 4, alpha 8); model.safetensors, tokenizer.json"), std::string::npos) << rg.out;
  const auto g2 = model::Model::load(file("out2")).weights().named(config_);
  ASSERT_EQ(g2.size(), w.size());
  for (size_t i = 0; i < w.size(); ++i) ASSERT_EQ(g2[i].second.to_f32_vector(), w[i].second.to_f32_vector()) << w[i].first;
  EXPECT_TRUE(fs::exists(file("out2/tokenizer.json")));
}

TEST_F(LoraExportCli, ImpossibleCombinationsAreOneLineErrors) {
  auto one_line = [](const testing::CommandResult& r, const std::string& needle) {
    EXPECT_EQ(r.code, 1) << r.out;
    EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << r.out;
    EXPECT_NE(r.out.find(needle), std::string::npos) << r.out;
  };
  const std::string out = file("out");
  const std::string merge = "export --merge-lora " + file("adapter") + " --model " + file("base");
  one_line(run_cli(merge + " --format gguf --out " + out), "merge first, then export to GGUF");
  one_line(run_cli(merge + " --out " + out + " --type q8_0"), "--type and --name apply to --format gguf");
  one_line(run_cli("export --format hf --model " + file("base") + " --out " + out), "--format hf needs --merge-lora");
  one_line(run_cli("export --model " + file("base") + " --out " + out), "--format is required");
  one_line(run_cli(merge + " --out " + file("base")), "is the base model");
  one_line(run_cli("export --merge-lora " + file("none") + " --model " + file("base") + " --out " + out), "none");
  EXPECT_FALSE(fs::exists(out));
  // An adapter for another shape of model: the tensor, expected and got.
  model::ModelConfig wide = config_;
  wide.intermediate_size = 96;
  model::save_peft_adapter(file("wide"), wide, model::LoraWeights::init(wide, adapter_.config, 1), "x");
  one_line(run_cli("export --merge-lora " + file("wide") + " --model " + file("base") + " --out " + out),
           "mlp.gate_proj.lora_B.weight' has shape (96, 4), expected (128, 4)");
  EXPECT_FALSE(fs::exists(out));
}

}  // namespace
}  // namespace tessera
