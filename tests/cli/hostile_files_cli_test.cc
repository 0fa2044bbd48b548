// Hostile model-directory files (config.json, tokenizer.json, tokenizer_config.json) through
// the real CLI: every class of the audit ends with exit 1 and one line naming the file and
// the key, never a signal, never a raw library message.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "test_util/run_command.h"

namespace tessera {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

struct CliResult {
  int code;
  std::string out, err;
};

class HostileFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = (fs::temp_directory_path() / ("tessera_hostile_" + std::to_string(::getpid()) + "_" +
                                         ::testing::UnitTest::GetInstance()->current_test_info()->name()))
               .string();
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  void write(const std::string& name, const std::string& bytes) {
    fs::create_directories(fs::path(dir_ + "/" + name).parent_path());
    std::ofstream(dir_ + "/" + name, std::ios::binary) << bytes;
  }
  CliResult run(const std::string& args) {
    const std::string err_file = dir_ + "/stderr.txt";
    const auto r = testing::run_command(std::string(TESSERA_CLI_PATH) + " " + args + " 2>" + err_file, false);
    std::ifstream f(err_file);
    std::stringstream err;
    err << f.rdbuf();
    return {r.code, r.out, err.str()};
  }
  // Exit 1 (not a signal: the shell reports those as 128 + N) and one line with every fragment.
  void expect_one_line_error(const CliResult& r, std::initializer_list<std::string> fragments) {
    EXPECT_EQ(r.code, 1) << r.err;
    EXPECT_EQ(r.err.rfind("tessera: error: ", 0), 0u) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err.substr(0, 2000);
    for (const auto& f : fragments) EXPECT_NE(r.err.find(f), std::string::npos) << f << " in: " << r.err.substr(0, 2000);
    EXPECT_EQ(r.err.find("json.exception"), std::string::npos) << r.err;
    EXPECT_EQ(r.err.find("bad_alloc"), std::string::npos) << r.err;
  }

  // A trained byte-level tokenizer in DIR/tok, returned as JSON for mutation.
  json trained_tokenizer() {
    std::string corpus;
    for (int i = 0; i < 20; ++i) corpus += "The quick brown fox jumps over the lazy dog " + std::to_string(i) + "\n";
    write("corpus.txt", corpus);
    const auto t = run("tokenizer train --input " + dir_ + "/corpus.txt --vocab-size 280 --out " + dir_ +
                       "/tok --quiet");
    EXPECT_EQ(t.code, 0) << t.err;
    std::ifstream f(dir_ + "/tok/tokenizer.json");
    return json::parse(f);
  }
  CliResult encode(const json& tokenizer) {
    write("tok/tokenizer.json", tokenizer.dump());
    return run("tokenizer encode --tokenizer " + dir_ + "/tok --text hello");
  }

  static json llama_config() {
    return {{"model_type", "llama"},       {"vocab_size", 256},       {"hidden_size", 64},
            {"intermediate_size", 128},   {"num_hidden_layers", 2},  {"num_attention_heads", 4},
            {"num_key_value_heads", 2},   {"max_position_embeddings", 128}};
  }
  // Any command that loads a model directory reads config.json first.
  CliResult generate_with(const std::string& config_text) {
    write("model/config.json", config_text);
    return run("generate --model " + dir_ + "/model --prompt-ids 1,2 --max-tokens 1");
  }

  std::string dir_;
};

std::string nested(int depth, const std::string& inner) {
  return std::string(depth, '[') + inner + std::string(depth, ']');
}

TEST_F(HostileFiles, DeeplyNestedTokenizerJsonIsAOneLineError) {
  json tok = trained_tokenizer();
  std::string text = tok.dump();
  // An unused field nested 10^6 deep (2 MB), as the audit sent.
  text.insert(1, "\"unused\": " + nested(1000000, "1") + ", ");
  write("tok/tokenizer.json", text);
  const auto r = run("tokenizer encode --tokenizer " + dir_ + "/tok --text hello");
  expect_one_line_error(r, {"tokenizer.json:1:", "nested deeper than 128 levels"});
}

TEST_F(HostileFiles, DeeplyNestedTokenizerConfigIsAOneLineError) {
  trained_tokenizer();
  write("tok/tokenizer_config.json", "{\"x\": " + nested(100000, "") + "}");
  const auto r = run("tokenizer encode --tokenizer " + dir_ + "/tok --text hello");
  expect_one_line_error(r, {"tokenizer_config.json:1:", "nested deeper than"});
}

TEST_F(HostileFiles, HugeTokenIdIsRefusedBeforeAllocating) {
  json tok = trained_tokenizer();
  tok["added_tokens"].push_back({{"id", 2147483646}, {"content", "<huge>"}, {"special", true}});
  expect_one_line_error(encode(tok), {"tokenizer.json", "token id 2147483646", "unused"});
  json vocab_id = trained_tokenizer();
  vocab_id["model"]["vocab"]["zzz"] = 9999999999LL;  // beyond int32
  expect_one_line_error(encode(vocab_id), {"tokenizer.json", "model.vocab['zzz']"});
}

TEST_F(HostileFiles, WrongTypesInTokenizerJsonNameTheKey) {
  json base = trained_tokenizer();
  json model_type = base;
  model_type["model"]["type"] = 5;
  expect_one_line_error(encode(model_type), {"tokenizer.json", "model.type", "expected a string"});
  json prefix = base;
  prefix["pre_tokenizer"] = {{"type", "ByteLevel"}, {"add_prefix_space", "yes"}};
  expect_one_line_error(encode(prefix), {"tokenizer.json", "add_prefix_space", "expected true or false"});
  json decoder = base;
  decoder["decoder"] = {{"type", json::array({1, 2})}};
  expect_one_line_error(encode(decoder), {"tokenizer.json", "decoder"});
  json post = base;
  post["post_processor"] = {{"type", "TemplateProcessing"},
                            {"single", json::array({{{"SpecialToken", {{"id", "<s>"}}}}})},
                            {"special_tokens", {{"<s>", 7}}}};
  expect_one_line_error(encode(post), {"tokenizer.json", "post_processor"});
  json post_id = base;
  post_id["post_processor"] = {{"type", "BertProcessing"},
                               {"cls", json::array({"a", 4294967297LL})},
                               {"sep", json::array({"b", 1})}};
  expect_one_line_error(encode(post_id), {"tokenizer.json", "post_processor.cls[1]", "expected a token id"});
}

TEST_F(HostileFiles, DeeplyNestedWronglyTypedConfigValueIsAOneLineError) {
  json c = llama_config();
  std::string text = c.dump();
  text.replace(text.find("\"hidden_size\":64"), 16, "\"hidden_size\":" + nested(200000, "64"));
  expect_one_line_error(generate_with(text), {"config.json:1:", "nested deeper than 128 levels"});
  // Under the limit: the error describes the value instead of printing it.
  text = c.dump();
  text.replace(text.find("\"hidden_size\":64"), 16, "\"hidden_size\":" + nested(100, "64"));
  expect_one_line_error(generate_with(text), {"config.json", "'hidden_size' must be an integer", "an array"});
}

TEST_F(HostileFiles, HugeConfigSizesNameTheKey) {
  for (const auto& [key, value] : std::vector<std::pair<std::string, std::string>>{
           {"hidden_size", "1099511627776"},
           {"num_hidden_layers", "4611686018427387904"},
           {"vocab_size", "18446744073709551615"},
           {"head_dim", "9223372036854775807"},
           {"intermediate_size", "-5"},
           {"num_attention_heads", "100000000000000000000"}}) {
    std::string text = llama_config().dump();
    const std::string needle = "\"" + key + "\":";
    if (text.find(needle) == std::string::npos) {
      text.insert(1, needle + value + ",");
    } else {
      const size_t at = text.find(needle) + needle.size();
      text.replace(at, text.find_first_of(",}", at) - at, value);
    }
    const auto r = generate_with(text);
    // A 20-digit literal beyond uint64 is a float for the JSON parser: "must be an integer".
    expect_one_line_error(r, {"config.json", "'" + key + "'"});
    EXPECT_EQ(r.err.find("out of memory"), std::string::npos) << r.err;
  }
  json gpt2 = {{"model_type", "gpt2"}, {"vocab_size", 256}, {"n_embd", 70368744177664LL}, {"n_layer", 2},
               {"n_head", 4}};
  expect_one_line_error(generate_with(gpt2.dump()), {"config.json", "'n_embd'", "must be in [1, "});
}

TEST_F(HostileFiles, NonsenseConfigFloatsAndIdsNameTheKey) {
  json eps = llama_config();
  eps["rms_norm_eps"] = 1e300;
  expect_one_line_error(generate_with(eps.dump()), {"config.json", "'rms_norm_eps'"});
  json theta = llama_config();
  theta["rope_theta"] = -1.0;
  expect_one_line_error(generate_with(theta.dump()), {"config.json", "'rope_theta'"});
  json eos = llama_config();
  eos["eos_token_id"] = 1000000;
  expect_one_line_error(generate_with(eos.dump()), {"config.json", "'eos_token_id'", "outside the vocabulary"});
}

// The planner reads the same config.json (MoE and MLA keys too) with the same bounds.
TEST_F(HostileFiles, PlannerRefusesHugeConfigSizesNamingTheKey) {
  json moe = llama_config();
  moe["num_local_experts"] = 1099511627776LL;
  moe["num_experts_per_tok"] = 2;
  write("moe/config.json", moe.dump());
  expect_one_line_error(run("plan train --model " + dir_ + "/moe --gpu h100-80g --gpus 8 --seq 128"),
                        {"config.json", "'num_local_experts'", "must be in [0, 4096]"});
  json deep = llama_config();
  deep["moe_intermediate_size"] = json::array({json::array({1})});
  deep["num_local_experts"] = 8;
  deep["num_experts_per_tok"] = 2;
  write("deep/config.json", deep.dump());
  expect_one_line_error(run("plan train --model " + dir_ + "/deep --gpu h100-80g --gpus 8 --seq 128"),
                        {"config.json", "'moe_intermediate_size' must be an integer, got an array of 1 items"});
}

}  // namespace
}  // namespace tessera
