// `tessera tokenizer train|encode|decode` end to end: outputs agree with the library,
// and bad input gives one error line, a non-zero exit and leaves --out untouched.
#include <gtest/gtest.h>

#include "test_util/run_command.h"
#include <unistd.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "tessera/io/json_file.h"
#include "tessera/io/tokenizer.h"

namespace tessera {
namespace {

struct CliResult {
  int code;
  std::string out, err;
};

// Runs the CLI with stdout and stderr kept apart (stdout is the data: ids or text).
CliResult tessera_cli(const std::string& args, const std::string& dir) {
  const std::string err_file = dir + "/stderr.txt";
  const auto r = testing::run_command(std::string(TESSERA_CLI_PATH) + " " + args + " 2>" + err_file,
                                      /*merge_stderr=*/false);
  std::ifstream f(err_file);
  std::stringstream err;
  err << f.rdbuf();
  return {r.code, r.out, err.str()};
}

class TokenizerCli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = (std::filesystem::temp_directory_path() / ("tessera_tokcli_" + std::to_string(::getpid()) + "_" +
                                                      ::testing::UnitTest::GetInstance()->current_test_info()->name()))
               .string();
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
    std::string corpus;
    for (int i = 0; i < 20; ++i)
      corpus += "The quick brown fox jumps over the lazy dog. Привет мир! 数据 " + std::to_string(i * 37) + "\n";
    write("corpus.txt", corpus);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  void write(const std::string& name, const std::string& bytes) {
    std::ofstream(dir_ + "/" + name, std::ios::binary) << bytes;
  }
  std::string read(const std::string& name) {
    std::ifstream f(dir_ + "/" + name, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(f), {});
  }
  CliResult run(const std::string& args) { return tessera_cli(args, dir_); }
  // One line "tessera: error: ..." that contains `fragment`.
  void expect_one_line_error(const CliResult& r, const std::string& fragment) {
    EXPECT_NE(r.code, 0) << r.err;
    EXPECT_EQ(r.err.rfind("tessera: error: ", 0), 0u) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_NE(r.err.find(fragment), std::string::npos) << r.err;
  }
  std::string dir_;
};

TEST_F(TokenizerCli, TrainEncodeDecodeAgreeWithLibrary) {
  const auto t = run("tokenizer train --input " + dir_ + "/corpus.txt --vocab-size 300 --out " + dir_ + "/tok --quiet");
  ASSERT_EQ(t.code, 0) << t.err;
  ASSERT_TRUE(std::filesystem::exists(dir_ + "/tok/tokenizer.json"));
  ASSERT_TRUE(std::filesystem::exists(dir_ + "/tok/tokenizer_config.json"));
  const auto tok = io::Tokenizer::load(dir_ + "/tok");
  EXPECT_EQ(tok.vocab_size(), 300);

  const std::string text = "The lazy fox, Привет! 123 <|endoftext|>";
  const auto e = run("tokenizer encode --tokenizer " + dir_ + "/tok --text '" + text + "'");
  ASSERT_EQ(e.code, 0) << e.err;
  std::string want;
  for (int32_t id : tok.encode(text)) want += (want.empty() ? "" : " ") + std::to_string(id);
  EXPECT_EQ(e.out, want + "\n");

  write("in.txt", text + "\n\n");
  const auto ef = run("tokenizer encode --tokenizer " + dir_ + "/tok/tokenizer.json --file " + dir_ + "/in.txt");
  ASSERT_EQ(ef.code, 0) << ef.err;
  want.clear();
  for (int32_t id : tok.encode(text + "\n\n")) want += (want.empty() ? "" : " ") + std::to_string(id);
  EXPECT_EQ(ef.out, want + "\n");

  const std::string ids = e.out.substr(0, e.out.size() - 1);
  const auto d = run("tokenizer decode --tokenizer " + dir_ + "/tok --ids '" + ids + "'");
  ASSERT_EQ(d.code, 0) << d.err;
  EXPECT_EQ(d.out, text);
  const auto ds = run("tokenizer decode --tokenizer " + dir_ + "/tok --skip-special-tokens --ids '" + ids + "'");
  EXPECT_EQ(ds.out, "The lazy fox, Привет! 123 ");
  const auto dc = run("tokenizer decode --tokenizer " + dir_ + "/tok --ids 84,104");
  EXPECT_EQ(dc.out, tok.decode({84, 104}));
}

TEST_F(TokenizerCli, HelpForEachSubcommand) {
  for (const char* c : {"tokenizer --help", "tokenizer train --help", "tokenizer encode --help",
                        "tokenizer decode --help", "bench tokenizer --help"}) {
    const auto r = run(c);
    EXPECT_EQ(r.code, 0) << c;
    EXPECT_NE(r.out.find("Usage"), std::string::npos) << c;
  }
}

TEST_F(TokenizerCli, BadTrainingInputFailsAndOverwritesNothing) {
  // A tokenizer already in --out must survive every failed run byte for byte.
  std::filesystem::create_directories(dir_ + "/out");
  write("out/tokenizer.json", "previous tokenizer");
  write("empty.txt", "");
  write("tiny.txt", "abcdefgh");
  const std::string out = " --out " + dir_ + "/out --quiet";
  expect_one_line_error(run("tokenizer train --input " + dir_ + "/empty.txt --vocab-size 300" + out),
                        "corpus is empty");
  expect_one_line_error(run("tokenizer train --input " + dir_ + "/missing.txt --vocab-size 300" + out),
                        "missing.txt: cannot open");
  expect_one_line_error(run("tokenizer train --input " + dir_ + "/corpus.txt --vocab-size 200" + out),
                        "less than the minimum 257");
  expect_one_line_error(run("tokenizer train --input " + dir_ + "/corpus.txt --vocab-size 100000" + out),
                        "more than this corpus allows");
  expect_one_line_error(run("tokenizer train --input " + dir_ + "/tiny.txt --vocab-size 262" + out),
                        "no pair occurs at least 2 times");
  EXPECT_EQ(read("out/tokenizer.json"), "previous tokenizer");
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/out/tokenizer_config.json"));
  write("afile", "x");
  expect_one_line_error(run("tokenizer train --input " + dir_ + "/corpus.txt --vocab-size 300 --out " + dir_ +
                            "/afile --quiet"),
                        "exists and is not a directory");
  // Missing required flags: CLI11's usage error, still a non-zero exit.
  EXPECT_NE(run("tokenizer train --input " + dir_ + "/corpus.txt").code, 0);
}

TEST_F(TokenizerCli, BadEncodeAndDecodeInput) {
  ASSERT_EQ(run("tokenizer train --input " + dir_ + "/corpus.txt --vocab-size 280 --out " + dir_ + "/tok --quiet").code,
            0);
  const std::string tok = " --tokenizer " + dir_ + "/tok";
  expect_one_line_error(run("tokenizer decode" + tok + " --ids '1 2 99999'"), "token id 99999 is not in the vocabulary");
  expect_one_line_error(run("tokenizer decode" + tok + " --ids '1 x 3'"), "'x' is not a non-negative token id");
  expect_one_line_error(run("tokenizer encode" + tok + " --text a --file " + dir_ + "/corpus.txt"),
                        "exactly one of --file and --text");
  expect_one_line_error(run("tokenizer encode" + tok), "exactly one of --file and --text");
  expect_one_line_error(run("tokenizer encode --tokenizer " + dir_ + "/nowhere --text a"), "nowhere");
  write("bad.txt", "ok \xFF bad");
  expect_one_line_error(run("tokenizer encode" + tok + " --file " + dir_ + "/bad.txt"), "not valid UTF-8 at byte 3");
  const auto empty = run("tokenizer encode" + tok + " --text ''");
  EXPECT_EQ(empty.code, 0) << empty.err;
  EXPECT_EQ(empty.out, "\n");
}

TEST_F(TokenizerCli, JsonIdsFileAndStream) {
  ASSERT_EQ(run("tokenizer train --input " + dir_ + "/corpus.txt --vocab-size 300 --out " + dir_ + "/tok --quiet").code,
            0);
  const auto lib = io::Tokenizer::load(dir_ + "/tok");
  const std::string tok = " --tokenizer " + dir_ + "/tok";
  const std::string text = "Привет <|endoftext|> fox 数据";
  const auto e = run("tokenizer encode" + tok + " --json --text '" + text + "'");
  ASSERT_EQ(e.code, 0) << e.err;
  const auto ids = lib.encode(text);
  EXPECT_EQ(nlohmann::json::parse(e.out).get<std::vector<int32_t>>(), ids);
  write("ids.json", e.out);
  EXPECT_EQ(run("tokenizer decode" + tok + " --ids-file " + dir_ + "/ids.json").out, text);
  EXPECT_EQ(run("tokenizer decode" + tok + " --ids-file " + dir_ + "/ids.json --skip-special-tokens").out,
            lib.decode(ids, true));
  // --stream: token by token as generation prints it, special tokens left out.
  EXPECT_EQ(run("tokenizer decode" + tok + " --ids-file " + dir_ + "/ids.json --stream").out, lib.decode(ids, true));
  expect_one_line_error(run("tokenizer decode" + tok), "exactly one of --ids and --ids-file");
  expect_one_line_error(run("tokenizer decode" + tok + " --ids 1 --ids-file " + dir_ + "/ids.json"),
                        "exactly one of --ids and --ids-file");
  write("bad_ids.json", "[1, -2]");
  expect_one_line_error(run("tokenizer decode" + tok + " --ids-file " + dir_ + "/bad_ids.json"),
                        "--ids-file: '-2' is not a non-negative token id");
  // A tokenizer.json of a model Tessera does not implement: one line naming the field.
  auto j = io::read_json_file(dir_ + "/tok/tokenizer.json");
  j["model"]["type"] = "Unigram";
  write("unigram.json", j.dump());
  expect_one_line_error(run("tokenizer encode --tokenizer " + dir_ + "/unigram.json --text a"),
                        "model.type is 'Unigram'");
}

}  // namespace
}  // namespace tessera
