// The `tessera` command end to end: outputs checked against the PyTorch reference,
// bad input gives one error line and a non-zero exit.
#include <gtest/gtest.h>

#include "test_util/run_command.h"

#include <array>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "../model/parity_fixture.h"
#include "tessera/io/safetensors.h"

namespace tessera {
namespace {

using Run = testing::CommandResult;

Run run(const std::string& args) { return testing::run_cli(args); }

int count_lines(const std::string& s) {
  int n = 0;
  for (char c : s) n += c == '\n';
  return n;
}

TEST(Cli, HelpForEveryCommand) {
  for (const char* c : {"--help", "generate --help", "eval perplexity --help", "bench decode --help",
                        "bench gemm --help", "quickstart --help", "train --help", "plot --help",
                        "tokenizer train --help", "data prepare --help", "bench train --help",
                        "bench serve --help", "bench comm --help"}) {
    const auto r = run(c);
    EXPECT_EQ(r.code, 0) << c;
    EXPECT_NE(r.out.find("Usage"), std::string::npos) << c << ": " << r.out;
  }
}

TEST(Cli, GreedyFirstTokenIsPyTorchArgmax) {
  const std::string dir = testing::parity_dir("llama");
  ASSERT_FALSE(dir.empty());
  const auto ref = io::SafetensorsFile::open(dir + "/reference.safetensors");
  const Tensor ids = ref->get("input_ids"), logits = ref->get("logits");
  const int64_t T = ids.size(1), V = logits.size(2);
  std::string prompt;
  for (int64_t t = 0; t < T; ++t)
    prompt += std::string(t ? "," : "") + std::to_string(ids.data<int32_t>()[t]);
  const float* last = logits.data<float>() + (T - 1) * V;
  const int64_t argmax = std::max_element(last, last + V) - last;
  const auto r = run("generate --model " + dir + " --prompt-ids " + prompt + " --max-tokens 3");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(r.out.substr(0, r.out.find(',')), std::to_string(argmax)) << r.out;
}

// `--speculative ngram` alone works (README's command; it failed with "speculative decoding
// needs num_speculative_tokens > 0") and, greedy, prints what plain decoding prints.
TEST(Cli, SpeculativeAloneUsesADefaultProposalCount) {
  const std::string dir = testing::parity_dir("llama");
  const std::string base = "generate --model " + dir + " --prompt-ids 5,6,7,5,6,7,5,6 --max-tokens 12";
  const auto plain = run(base);
  const auto spec = run(base + " --speculative ngram");
  ASSERT_EQ(plain.code, 0) << plain.out;
  ASSERT_EQ(spec.code, 0) << spec.out;
  EXPECT_EQ(spec.out.substr(0, spec.out.find('\n')), plain.out.substr(0, plain.out.find('\n')));
}

// `generate --input` with "logprobs": each output carries the generated tokens'
// log-probabilities (the first equal to PyTorch's log_softmax at the prompt's last
// position), and `--output -` writes the lines to standard output.
TEST(Cli, GenerateBatchLogprobsToStdout) {
  const std::string dir = testing::parity_dir("llama");
  const auto ref = io::SafetensorsFile::open(dir + "/reference.safetensors");
  const Tensor ids = ref->get("input_ids"), logits = ref->get("logits");
  const int64_t T = ids.size(1), V = logits.size(2);
  const auto tmp = std::filesystem::temp_directory_path() / ("tessera_cli_lp_" + std::to_string(getpid()));
  std::filesystem::create_directories(tmp);
  {
    std::ofstream f(tmp / "in.jsonl");
    f << "{\"prompt_ids\": [";
    for (int64_t t = 0; t < T; ++t) f << (t ? "," : "") << ids.data<int32_t>()[t];
    f << "], \"max_tokens\": 3, \"logprobs\": 2}\n";
  }
  const auto r = testing::run_command(std::string(TESSERA_CLI_PATH) + " generate --model " + dir + " --input " +
                                          (tmp / "in.jsonl").string() + " --output - 2>/dev/null",
                                      /*merge_stderr=*/false);
  ASSERT_EQ(r.code, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out.substr(0, r.out.find('\n')));
  const auto& lps = j["outputs"][0]["logprobs"];
  ASSERT_EQ(lps.size(), 3u) << r.out;
  const float* row = logits.data<float>() + (T - 1) * V;
  const float m = *std::max_element(row, row + V);
  double sum = 0;
  for (int64_t v = 0; v < V; ++v) sum += std::exp(static_cast<double>(row[v] - m));
  const int32_t first = lps[0]["token_id"].get<int32_t>();
  EXPECT_EQ(first, j["outputs"][0]["token_ids"][0].get<int32_t>());
  EXPECT_NEAR(lps[0]["logprob"].get<double>(), row[first] - m - std::log(sum), 2e-3);
  EXPECT_EQ(lps[0]["top_logprobs"].size(), 2u);
  EXPECT_EQ(lps[0]["top_logprobs"][0]["token_id"].get<int32_t>(), first);  // greedy: the top one
  std::filesystem::remove_all(tmp);
}

// `tessera info`: the parameter count equals the tensors' elements in the safetensors, the
// KV bytes per token the formula 2 x layers x kv heads x head dim x 2 (bf16).
TEST(Cli, InfoReportsParametersAndKvMemory) {
  const std::string dir = testing::parity_dir("llama");
  const auto r = testing::run_command(std::string(TESSERA_CLI_PATH) + " info --model " + dir + " --json --context 100",
                                      /*merge_stderr=*/false);
  ASSERT_EQ(r.code, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  const io::SafetensorsModel st = io::SafetensorsModel::open(dir);
  int64_t params = 0;
  for (const auto& name : st.names()) {
    int64_t n = 1;
    for (int64_t d : st.info(name).shape) n *= d;
    params += n;
  }
  EXPECT_EQ(j["parameters"].get<int64_t>(), params);
  const int64_t L = j["layers"], H = j["kv_heads"], D = j["head_dim"];
  EXPECT_EQ(j["kv_bytes_per_token"].get<int64_t>(), 2 * L * H * D * 2);
  EXPECT_EQ(j["kv_bytes_for_context"].get<int64_t>(), 100 * 2 * L * H * D * 2);
  const auto text = run("info --model " + dir);
  EXPECT_EQ(text.code, 0) << text.out;
  EXPECT_NE(text.out.find("parameters"), std::string::npos) << text.out;
  EXPECT_NE(run("info --model /nonexistent").code, 0);
}

// `generate --stream`: the text's last line ends before the statistics line.
TEST(Cli, StreamedTextEndsWithANewlineBeforeTheStats) {
  const std::string dir = testing::parity_dir("llama");
  const auto r = run("generate --model " + dir + " --prompt-ids 1,2,3 --max-tokens 4 --stream");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("\ngenerated 4 tokens"), std::string::npos) << r.out;
}

// --input / --output: a file of requests as one engine batch; greedy first tokens equal
// PyTorch's argmax, every request gets a result line in input order.
TEST(Cli, GenerateBatchFileMatchesPyTorchArgmax) {
  const std::string dir = testing::parity_dir("llama");
  ASSERT_FALSE(dir.empty());
  const auto ref = io::SafetensorsFile::open(dir + "/reference.safetensors");
  const Tensor ids = ref->get("input_ids"), logits = ref->get("logits");
  const int64_t T = ids.size(1), V = logits.size(2);
  const auto tmp = std::filesystem::temp_directory_path() / ("tessera_cli_batch_" + std::to_string(getpid()));
  std::filesystem::create_directories(tmp);
  {
    std::ofstream f(tmp / "in.jsonl");
    for (int64_t len : {T, T - 1, T / 2, T}) {  // prefixes of the reference input
      f << "{\"id\": \"r" << len << "\", \"prompt_ids\": [";
      for (int64_t t = 0; t < len; ++t) f << (t ? "," : "") << ids.data<int32_t>()[t];
      f << "], \"max_tokens\": 4}\n";
    }
  }
  const auto r = run("generate --model " + dir + " --input " + (tmp / "in.jsonl").string() +
                     " --output " + (tmp / "out.jsonl").string() + " --max-num-batched-tokens 8");
  ASSERT_EQ(r.code, 0) << r.out;
  std::ifstream in(tmp / "out.jsonl");
  std::vector<std::string> lines;
  for (std::string l; std::getline(in, l);) lines.push_back(l);
  ASSERT_EQ(lines.size(), 4u);
  for (int i : {0, 1, 2}) {
    const int64_t len = i == 0 ? T : i == 1 ? T - 1 : T / 2;
    const float* row = logits.data<float>() + (len - 1) * V;
    const int64_t argmax = std::max_element(row, row + V) - row;
    EXPECT_NE(lines[i].find("\"token_ids\":[" + std::to_string(argmax)), std::string::npos)
        << "line " << i << ": " << lines[i];
    EXPECT_NE(lines[i].find("\"id\":\"r" + std::to_string(len) + "\""), std::string::npos) << lines[i];
  }
  {
    std::ofstream(tmp / "bad.jsonl") << "{\"prompt_ids\": [1, 2], \"top_p\": 2}\n";
  }
  const auto bad = run("generate --model " + dir + " --input " + (tmp / "bad.jsonl").string() +
                       " --output " + (tmp / "o.jsonl").string());
  EXPECT_NE(bad.code, 0);
  EXPECT_NE(bad.out.find("bad.jsonl:1: top_p"), std::string::npos) << bad.out;
  std::filesystem::remove_all(tmp);
}

TEST(Cli, EvalPerplexityMatchesPyTorch) {
  const std::string dir = testing::parity_dir("gpt2");
  ASSERT_FALSE(dir.empty());
  const auto ref = io::SafetensorsFile::open(dir + "/reference.safetensors");
  const auto r = run("eval perplexity --model " + dir + " --ids " + dir + "/eval_ids.txt --ctx " +
                     std::to_string(static_cast<int>(ref->get("eval_ctx").item_f32(0))));
  ASSERT_EQ(r.code, 0) << r.out;
  const auto pos = r.out.find("mean_nll ");
  ASSERT_NE(pos, std::string::npos) << r.out;
  const double nll = std::stod(r.out.substr(pos + 9));
  const double want = ref->get("eval_nll").item_f32(0);
  EXPECT_NEAR(nll, want, 5e-5 * want);
}

// --kl-reference: the model against itself diverges by nothing, its perplexity is still
// PyTorch's, and every figure is printed.
TEST(Cli, EvalPerplexityAgainstAReferencePrintsTheDivergence) {
  const std::string dir = testing::parity_dir("gpt2");
  ASSERT_FALSE(dir.empty());
  const auto ref = io::SafetensorsFile::open(dir + "/reference.safetensors");
  const auto r = run("eval perplexity --model " + dir + " --ids " + dir + "/eval_ids.txt --ctx " +
                     std::to_string(static_cast<int>(ref->get("eval_ctx").item_f32(0))) +
                     " --kl-reference " + dir);
  ASSERT_EQ(r.code, 0) << r.out;
  const auto value = [&](const std::string& key) {
    const auto pos = r.out.find("\n" + key + " ");
    EXPECT_NE(pos, std::string::npos) << key << "\n" << r.out;
    return pos == std::string::npos ? -1.0 : std::stod(r.out.substr(pos + key.size() + 2));
  };
  const double want = ref->get("eval_nll").item_f32(0);
  EXPECT_NEAR(value("mean_nll"), want, 5e-5 * want);
  EXPECT_NEAR(value("ref_nll"), want, 5e-5 * want);
  EXPECT_EQ(value("ln_ppl_ratio"), 0.0);
  EXPECT_LT(value("kld_mean"), 1e-9);
  for (const char* key : {"kld_median", "kld_p99", "kld_max", "rms_delta_p"}) EXPECT_LT(value(key), 1e-6) << key;
  EXPECT_EQ(value("same_top"), 100.0);
}

TEST(Cli, BadInputGivesOneLineAndNonZeroExit) {
  const std::string dir = testing::parity_dir("llama");
  const auto tmp = std::filesystem::temp_directory_path() / ("tessera_cli_" + std::to_string(getpid()));
  std::filesystem::create_directories(tmp);
  {
    std::ofstream(tmp / "bad_ids.txt") << "1 2 three 4";
  }
  std::ofstream(tmp / "sgd.toml") << "[data]\ndir = \"/nonexistent\"\n[optimizer]\nname = \"sgd\"\n";
  std::ofstream(tmp / "nodata.toml") << "[run]\nout_dir = \"" << (tmp / "run").string()
                                     << "\"\n[data]\ndir = \"/nonexistent/data\"\n";
  std::filesystem::create_directories(tmp / "badcfg");
  {
    std::ofstream(tmp / "badcfg/config.json") << R"({"model_type": "bert", "vocab_size": 10})";
  }
  struct Case {
    std::string args, must_mention;
  };
  const Case cases[] = {
      {"generate --model /nonexistent --prompt-ids 1", "/nonexistent"},
      {"generate --model " + (tmp / "bad_ids.txt").string() + " --prompt-ids 1", "not a GGUF file"},
      {"info --model " + (tmp / "bad_ids.txt").string(), "not a GGUF file"},
      {"generate --model " + dir + " --prompt-ids 1,x,3", "'x'"},
      {"generate --model " + dir + " --prompt-ids 1,99999", "99999"},
      {"generate --model " + dir + " --prompt-ids 1 --temperature -1", "temperature"},
      {"generate --model " + dir + " --prompt-ids 1 --top-p 0", "top_p"},
      {"generate --model " + dir + " --prompt-ids 1 --dtype f64", "f64"},
      {"generate --model " + dir + " --prompt-ids 1 --speculative draft", "draft model"},
      {"generate --model " + (tmp / "badcfg").string() + " --prompt-ids 1", "bert"},
      {"eval perplexity --model " + dir + " --ids " + (tmp / "bad_ids.txt").string(), "three"},
      {"eval perplexity --model " + dir + " --ids /nonexistent/ids.txt", "/nonexistent/ids.txt"},
      {"eval perplexity --model " + dir + " --ids " + dir + "/eval_ids.txt --kl-reference /nonexistent/ref",
       "/nonexistent/ref"},
      {"generate --model " + dir + " --prompt hello", "tokenizer.json"},
      {"train --config " + (tmp / "sgd.toml").string(), "optimizer.name"},
      {"train --config " + (tmp / "nodata.toml").string(), "/nonexistent/data"},
      {"train --config /nonexistent/run.toml", "/nonexistent/run.toml"},
      // A configuration error under the elastic supervisor ends the job at once, one line.
      {"train --config " + (tmp / "nodata.toml").string() + " --nproc 2 --max-restarts 3", "/nonexistent/data"},
  };
  for (const auto& c : cases) {
    const auto r = run(c.args);
    EXPECT_NE(r.code, 0) << c.args;
    EXPECT_EQ(count_lines(r.out), 1) << c.args << "\n" << r.out;
    EXPECT_NE(r.out.find(c.must_mention), std::string::npos) << c.args << "\n" << r.out;
  }
  std::filesystem::remove_all(tmp);
}

// A mistyped ISA cap would run the uncapped kernels while the user believes a fallback was
// tested: it is a one-line error before anything runs; the documented caps run.
TEST(Cli, UnknownIsaCapIsAnError) {
  const std::string dir = testing::parity_dir("llama");
  const std::string cmd = std::string(TESSERA_CLI_PATH) + " generate --model " + dir + " --prompt-ids 1,2 --max-tokens 2";
  const auto bad = testing::run_command("TESSERA_ISA=avx-512 " + cmd);
  EXPECT_EQ(bad.code, 1) << bad.out;
  EXPECT_EQ(count_lines(bad.out), 1) << bad.out;
  EXPECT_NE(bad.out.find("TESSERA_ISA='avx-512'"), std::string::npos) << bad.out;
  for (const char* ok : {"scalar", "avx2", "avx512", "amx", "native"}) {
    const auto r = testing::run_command(std::string("TESSERA_ISA=") + ok + " " + cmd);
    EXPECT_EQ(r.code, 0) << ok << "\n" << r.out;
  }
}

// Parse errors keep the one-line contract: exit 2, "tessera: error: ...", and a suggestion
// for a mistyped command or flag (issue 22: a mistyped flag exited 109, an unknown command
// said "A subcommand is required" with exit 106).
TEST(Cli, ParseErrorsAreOneLineWithExit2AndASuggestion) {
  const std::string dir = testing::parity_dir("llama");
  struct Case {
    std::string args, must_mention;
  };
  const Case cases[] = {
      {"trian", "did you mean 'train'?"},
      {"", "needs a command"},
      {"bench trian", "did you mean 'train'?"},
      {"generate --model " + dir + " --prompt-ids 1 --max-token 3", "did you mean '--max-tokens'?"},
      {"serve --model " + dir + " --kv-cache-memroy 2G", "did you mean '--kv-cache-memory'?"},
      {"generate --model " + dir + " --prompt-ids 1 --kv-cache-memory 2X", "--kv-cache-memory"},
      {"generate --model " + dir + " --prompt-ids 1 --max-tokens many", "--max-tokens"},
      // Flags whose callbacks parse the value (an uncaught exception aborted with 134).
      {"generate --model " + dir + " --prompt-ids 1 --kv-cache-dtype int4", "--kv-cache-dtype 'int4'"},
      {"serve --model " + dir + " --kv-cache-dtype e5m2", "--kv-cache-dtype 'e5m2'"},
      {"bench serve --model " + dir + " --compare-kv-cache-dtype q4", "--compare-kv-cache-dtype 'q4'"},
      // Quantization schemes are checked while parsing, before a model loads or a header prints.
      {"generate --model " + dir + " --prompt-ids 1 --quantization int3", "'int3'"},
      {"bench decode --shape 1b --weights int3", "'int3'"},
  };
  for (const auto& c : cases) {
    const auto r = run(c.args);
    EXPECT_EQ(r.code, 2) << c.args << "\n" << r.out;
    EXPECT_EQ(count_lines(r.out), 1) << c.args << "\n" << r.out;
    EXPECT_EQ(r.out.rfind("tessera: error: ", 0), 0u) << c.args << "\n" << r.out;
    EXPECT_NE(r.out.find(c.must_mention), std::string::npos) << c.args << "\n" << r.out;
  }
}

// Byte sizes take K/M/G suffixes (powers of 1024): 1K is 1024 bytes (too small for a KV
// block of this model: the error shows the bytes), 64M runs.
TEST(Cli, SizeFlagsAcceptSuffixes) {
  const std::string dir = testing::parity_dir("llama");
  const auto tiny = run("generate --model " + dir + " --prompt-ids 1,2 --max-tokens 2 --kv-cache-memory 1K");
  EXPECT_NE(tiny.code, 0) << tiny.out;
  EXPECT_NE(tiny.out.find("--kv-cache-memory 1024 bytes"), std::string::npos) << tiny.out;
  const auto ok = run("generate --model " + dir + " --prompt-ids 1,2 --max-tokens 2 --kv-cache-memory 64M");
  EXPECT_EQ(ok.code, 0) << ok.out;
}

}  // namespace
}  // namespace tessera
