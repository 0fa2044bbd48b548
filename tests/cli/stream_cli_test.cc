// --attention-sinks / --window and `tessera bench stream-ppl` end to end on a random tiny
// model saved to a directory: a stream past the context runs with sinks and is refused
// without; bad flags give one line; the perplexity bench writes its JSON and SVG.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <string>

#include <nlohmann/json.hpp>

#include "tessera/io/json_file.h"
#include "tessera/model/model.h"
#include "test_util/run_command.h"

namespace tessera {
namespace {

int count_lines(const std::string& s) { return static_cast<int>(std::count(s.begin(), s.end(), '\n')); }

class StreamCli : public ::testing::Test {
 protected:
  void SetUp() override {
    tmp_ = std::filesystem::temp_directory_path() / ("tessera_stream_cli_" + std::to_string(getpid()));
    std::filesystem::create_directories(tmp_);
    model::ModelConfig c = model::ModelConfig::named_shape("tiny");
    c.max_position_embeddings = 64;
    model::Model::random(c, DType::kF32, 7).save((tmp_ / "model").string());
    std::mt19937 rng(1);
    std::ofstream ids(tmp_ / "ids.txt");
    for (int i = 0; i < 300; ++i) ids << 3 + rng() % 250 << (i % 20 == 19 ? '\n' : ' ');
  }
  void TearDown() override { std::filesystem::remove_all(tmp_); }
  std::string model() const { return (tmp_ / "model").string(); }
  std::filesystem::path tmp_;
};

TEST_F(StreamCli, GenerateStreamsPastTheContextOnlyWithSinks) {
  const std::string base = "generate --model " + model() + " --prompt-ids 5,6,7 --max-tokens 200 --kv-cache-dtype f32";
  const auto plain = testing::run_cli(base);
  EXPECT_NE(plain.code, 0);
  EXPECT_NE(plain.out.find("exceeds the model's context of 64"), std::string::npos) << plain.out;
  const auto r = testing::run_cli(base + " --attention-sinks 4 --window 32 --block-size 8");
  ASSERT_EQ(r.code, 0) << r.out;
  const std::string ids = r.out.substr(0, r.out.find("generated"));  // stdout, then the summary on stderr
  EXPECT_EQ(std::count(ids.begin(), ids.end(), ','), 199) << r.out;  // 200 ids
  EXPECT_NE(r.out.find("generated 200 tokens (length)"), std::string::npos) << r.out;
}

TEST_F(StreamCli, BadFlagsGiveOneLine) {
  const std::string g = "generate --model " + model() + " --prompt-ids 5,6 --max-tokens 4";
  const std::string b = "bench stream-ppl --model " + model() + " --ids " + (tmp_ / "ids.txt").string();
  const std::pair<std::string, std::string> cases[] = {
      {g + " --attention-sinks 4", "--attention-sinks needs --window"},
      {g + " --window 32", "--window needs --attention-sinks"},
      {g + " --attention-sinks 4 --window 8", "--window must be at least --block-size"},
      {g + " --attention-sinks 4 --window 61", "--attention-sinks 4 + --window 61 = 65 exceeds the context length 64"},
      {g + " --attention-sinks 4 --window 32 --speculative ngram --num-speculative-tokens 2", "--speculative"},
      {b + " --window 61 --attention-sinks 4", "exceeds --context 64"},
      {b + " --window 32 --tokens 1000", "--tokens 1000: the text has only 300 tokens"},
  };
  for (const auto& [args, needle] : cases) {
    const auto r = testing::run_cli(args);
    EXPECT_NE(r.code, 0) << args;
    EXPECT_EQ(count_lines(r.out), 1) << args << "\n" << r.out;
    EXPECT_NE(r.out.find(needle), std::string::npos) << args << "\n" << r.out;
  }
}

TEST_F(StreamCli, StreamPplWritesEveryMethodsNumbersAndAPlot) {
  const std::string json = (tmp_ / "s.json").string(), svg = (tmp_ / "s.svg").string();
  const auto r = testing::run_cli("bench stream-ppl --model " + model() + " --ids " + (tmp_ / "ids.txt").string() +
                                  " --attention-sinks 4 --window 28 --block-size 8 --smooth 32 --json " + json +
                                  " --svg " + svg);
  ASSERT_EQ(r.code, 0) << r.out;
  const auto j = nlohmann::json::parse(io::read_file_bytes(json));
  ASSERT_EQ(j["methods"].size(), 3u);
  EXPECT_EQ(j["tokens"], 300);
  EXPECT_EQ(j["context"], 64);
  for (const auto& m : j["methods"]) {
    EXPECT_EQ(m["nll"].size(), 299u) << m["name"];
    for (const auto& x : m["nll"]) ASSERT_GT(x.get<double>(), 0.0);
  }
  EXPECT_EQ(j["methods"][0]["attention_sinks"], 4);
  EXPECT_EQ(j["methods"][0]["max_kv_blocks"], 4);  // (4 + 28) / 8
  EXPECT_EQ(j["methods"][1]["attention_sinks"], 0);
  EXPECT_EQ(j["methods"][1]["window"], 32);
  EXPECT_EQ(j["methods"][2]["max_kv_blocks"], (300 + 7) / 8);  // dense keeps everything
  const std::string s = io::read_file_bytes(svg);
  EXPECT_NE(s.find("<svg"), std::string::npos) << s.substr(0, 80);
  EXPECT_NE(s.find("attention sinks (4 + 28)"), std::string::npos);
  EXPECT_NE(s.find("context 64"), std::string::npos);
}

}  // namespace
}  // namespace tessera
