// `tessera export --format gguf` and `--model FILE.gguf` end to end: a model directory with
// its tokenizer exported to f32 GGUF generates the same text and perplexity as the directory,
// re-exporting the GGUF gives the same bytes, a q8_0 export runs quantized in generate and
// bench, and bad flags or files are one-line errors that write nothing.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "tessera/io/tokenizer.h"
#include "tessera/model/model.h"
#include "test_util/run_command.h"

namespace tessera {
namespace {

namespace fs = std::filesystem;
using testing::run_cli;

const char* kText =
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a "
    "single step. Hello world! How are you today? Numbers like 12345 appear in text.\n";

std::string read_all(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// stdout only.
testing::CommandResult run_quiet(const std::string& args) {
  return testing::run_command(std::string(TESSERA_CLI_PATH) + " " + args + " 2>/dev/null", false);
}

class GgufCli : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() / ("tessera_gguf_cli_" + std::to_string(::getpid()));
    fs::remove_all(root_);
    fs::create_directories(root_);
    const std::string corpus = file("corpus.txt");
    {
      std::ofstream out(corpus);
      for (int i = 0; i < 20; ++i) out << kText;
    }
    io::BpeTrainOptions bo;
    bo.vocab_size = 300;
    bo.special_tokens = {"<|endoftext|>"};
    bo.progress = false;
    const io::Tokenizer tok = io::train_bpe({corpus}, bo);
    auto c = model::ModelConfig::named_shape("tiny");
    c.vocab_size = tok.vocab_size();
    c.eos_token_id = tok.eos_id();
    c.bos_token_id = -1;
    model::Model::random(c, DType::kF32, 12).save(file("model"));
    tok.save(file("model"));
  }
  void TearDown() override { fs::remove_all(root_); }
  std::string file(const std::string& n) const { return (root_ / n).string(); }

  fs::path root_;
};

TEST_F(GgufCli, ExportedModelGeneratesAndScoresLikeTheDirectory) {
  auto r = run_cli("export --format gguf --model " + file("model") + " --out " + file("m.gguf") + " --type f32");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("wrote " + file("m.gguf") + ": llama, 21 tensors (21 F32)"), std::string::npos) << r.out;

  const std::string gen = " --prompt 'Hello world' --max-tokens 10";
  const auto from_dir = run_quiet("generate --model " + file("model") + gen);
  const auto from_gguf = run_quiet("generate --model " + file("m.gguf") + gen);
  ASSERT_EQ(from_dir.code, 0);
  ASSERT_EQ(from_gguf.code, 0);
  EXPECT_EQ(from_gguf.out, from_dir.out);
  const std::string ppl = " --data " + file("corpus.txt") + " --ctx 64";
  const auto ppl_dir = run_quiet("eval perplexity --model " + file("model") + ppl);
  const auto ppl_gguf = run_quiet("eval perplexity --model " + file("m.gguf") + ppl);
  ASSERT_EQ(ppl_gguf.code, 0);
  EXPECT_EQ(ppl_gguf.out, ppl_dir.out);

  // A GGUF file is a model path like a directory: exporting it again changes nothing.
  r = run_cli("export --format gguf --model " + file("m.gguf") + " --out " + file("again.gguf") +
              " --type f32 --name model");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(read_all(file("again.gguf")), read_all(file("m.gguf")));
}

TEST_F(GgufCli, Q8ExportRunsQuantized) {
  auto r = run_cli("export --format gguf --model " + file("model") + " --out " + file("q8.gguf") + " --type q8_0");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("(5 F32, 16 Q8_0)"), std::string::npos) << r.out;
  const auto gen = run_quiet("generate --model " + file("q8.gguf") + " --prompt-ids 1,2,3 --max-tokens 6");
  EXPECT_EQ(gen.code, 0);
  r = run_cli("bench decode --model " + file("q8.gguf") + " --tokens 4 --repeats 1");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("weights int8 g32"), std::string::npos) << r.out;
  r = run_cli("generate --model " + file("q8.gguf") + " --prompt-ids 1,2 --max-tokens 2 --quantization int4");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("already quantized"), std::string::npos) << r.out;
}

TEST_F(GgufCli, BadFlagsAndFilesAreOneLineErrors) {
  auto one_line = [](const testing::CommandResult& r, const std::string& needle) {
    EXPECT_EQ(r.code, 1) << r.out;
    EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << r.out;
    EXPECT_NE(r.out.find(needle), std::string::npos) << r.out;
  };
  const std::string out = file("bad.gguf");
  one_line(run_cli("export --format gguf --model " + file("model") + " --out " + out + " --type q5_k"),
           "--type 'q5_k' is not one of f32, f16, bf16, q8_0, q4_0, q4_k");
  one_line(run_cli("export --format onnx --model " + file("model") + " --out " + out), "--format 'onnx'");
  one_line(run_cli("export --format gguf --model " + file("none") + " --out " + out), "none");
  EXPECT_FALSE(fs::exists(out));

  ASSERT_EQ(run_cli("export --format gguf --model " + file("model") + " --out " + file("m.gguf")).code, 0);
  const std::string whole = read_all(file("m.gguf"));
  std::ofstream(file("cut.gguf"), std::ios::binary) << whole.substr(0, whole.size() / 2);
  one_line(run_cli("generate --model " + file("cut.gguf") + " --prompt-ids 1 --max-tokens 1"),
           "cut.gguf: tensor '");
  std::ofstream(file("junk.gguf"), std::ios::binary) << "not a model";
  one_line(run_cli("generate --model " + file("junk.gguf") + " --prompt-ids 1 --max-tokens 1"),
           "junk.gguf: not a GGUF file");
}

}  // namespace
}  // namespace tessera
