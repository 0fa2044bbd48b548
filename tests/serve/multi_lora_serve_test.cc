// Multi-LoRA serving through `tessera serve --lora NAME=DIR`: /v1/models lists the adapters
// (parent = the base model, as vLLM), a request naming an adapter gets the greedy tokens of
// the base model with that adapter merged into its weights (model::merge_lora, run alone in
// an engine), the base name still serves the base, an unknown name is model_not_found, and
// bad --lora flags are one-line errors.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <random>

#include "test_util/lora_adapters.h"
#include "serve/server_process.h"
#include "test_util/run_command.h"
#include "tessera/infer/engine.h"
#include "tessera/model/lora.h"
#include "tessera/model/lora_io.h"
#include "tessera/model/model.h"

namespace tessera {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using testing::ServerProcess;

const std::string kModel = TESSERA_SERVE_MODEL;

// The greedy tokens of `prompt` alone in an engine over the serve model, with `adapter_dir`
// (read back as the server reads it) merged into the weights; "" for the base.
std::vector<int32_t> expected(const std::string& adapter_dir, const std::vector<int32_t>& prompt, int64_t n) {
  model::Model m = model::Model::load(kModel, DType::kF32);
  if (!adapter_dir.empty()) model::merge_lora(m, model::load_peft_adapter(adapter_dir, m.config()));
  infer::EngineConfig ec;
  ec.kv_cache_memory = 8 << 20;
  ec.kv_cache_dtype = kernels::KvCacheDtype::kF32;
  infer::Engine e(m, ec);
  infer::SamplingParams sp;
  sp.max_tokens = n;
  sp.ignore_eos = true;
  e.add_request(prompt, sp);
  std::vector<int32_t> out;
  while (e.has_unfinished())
    for (const auto& o : e.step()) out.insert(out.end(), o.new_tokens.begin(), o.new_tokens.end());
  return out;
}

class MultiLoraServe : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = (fs::temp_directory_path() / ("tessera_mlora_" + std::to_string(::getpid()))).string();
    const model::Model m = model::Model::load(kModel, DType::kF32);
    model::LoraConfig a, b;
    a.rank = 4, a.alpha = 8;
    a.targets = {model::LoraModule::kQ, model::LoraModule::kK, model::LoraModule::kV, model::LoraModule::kO,
                 model::LoraModule::kGate, model::LoraModule::kUp, model::LoraModule::kDown};
    b.rank = 2, b.alpha = 4;
    b.targets = {model::LoraModule::kQ, model::LoraModule::kV};
    model::save_peft_adapter(dir_ + "/alpha", m.config(), testing::trained_lora(m.config(), a, 1, 0.3f), kModel);
    model::save_peft_adapter(dir_ + "/beta", m.config(), testing::trained_lora(m.config(), b, 2, 0.3f), kModel);
    server_ = new ServerProcess({"--model", kModel, "--lora", "alpha=" + dir_ + "/alpha", "--lora",
                                 "beta=" + dir_ + "/beta", "--kv-cache-dtype", "f32", "--block-size", "8"});
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
    fs::remove_all(dir_);
  }
  static ServerProcess* server_;
  static std::string dir_;
};
ServerProcess* MultiLoraServe::server_ = nullptr;
std::string MultiLoraServe::dir_;

// The streamed token ids of a greedy completion of `prompt` by `model`.
std::vector<int32_t> served_tokens(httplib::Client& c, const std::string& model, const std::vector<int32_t>& prompt,
                                   int64_t n) {
  const json body = {{"model", model}, {"prompt", prompt}, {"max_tokens", n}, {"temperature", 0},
                     {"ignore_eos", true}, {"stream", true}};
  auto r = c.Post("/v1/completions", body.dump(), "application/json");
  EXPECT_TRUE(r && r->status == 200) << (r ? r->body : "no response");
  std::vector<int32_t> out;
  if (!r) return out;
  for (const auto& e : testing::sse_data(r->body)) {
    if (e == "[DONE]") continue;
    const json chunk = json::parse(e);
    EXPECT_EQ(chunk["model"], model);
    for (const auto& t : chunk["choices"][0]["token_ids"]) out.push_back(t.get<int32_t>());
  }
  return out;
}

TEST_F(MultiLoraServe, ModelsListsTheAdaptersWithTheBaseAsParent) {
  auto c = server_->client();
  auto r = c.Get("/v1/models");
  ASSERT_TRUE(r && r->status == 200);
  const json d = json::parse(r->body)["data"];
  ASSERT_EQ(d.size(), 3u) << r->body;
  EXPECT_EQ(d[0]["id"], "serve_model");
  EXPECT_TRUE(d[0]["parent"].is_null());
  EXPECT_EQ(d[1]["id"], "alpha");
  EXPECT_EQ(d[2]["id"], "beta");
  for (int i = 1; i < 3; ++i) {
    EXPECT_EQ(d[i]["object"], "model");
    EXPECT_EQ(d[i]["parent"], "serve_model");
    EXPECT_EQ(d[i]["root"], dir_ + (i == 1 ? "/alpha" : "/beta"));
  }
}

// An adapter is a model: retrievable by id, and its embeddings are its merged model's mean
// final-norm hidden state (the dense forward, averaged here).
TEST_F(MultiLoraServe, AdaptersAreRetrievableAndEmbed) {
  auto c = server_->client();
  auto r = c.Get("/v1/models/alpha");
  ASSERT_TRUE(r && r->status == 200) << (r ? r->body : "");
  const json m = json::parse(r->body);
  EXPECT_EQ(m["parent"], "serve_model");
  EXPECT_EQ(m["root"], dir_ + "/alpha");
  EXPECT_EQ(m, json::parse(c.Get("/v1/models")->body)["data"][1]);
  const std::vector<int32_t> prompt = {5, 9, 20, 33, 7, 100, 41, 12, 250, 3, 77};
  auto embed = [&](const std::string& name) {
    auto e = c.Post("/v1/embeddings", json({{"model", name}, {"input", prompt}}).dump(), "application/json");
    EXPECT_TRUE(e && e->status == 200) << (e ? e->body : "");
    const json j = json::parse(e->body);
    EXPECT_EQ(j["model"], name);
    return j["data"][0]["embedding"].get<std::vector<float>>();
  };
  const auto alpha = embed("alpha"), base = embed("serve_model");
  model::Model merged = model::Model::load(kModel, DType::kF32);
  model::merge_lora(merged, model::load_peft_adapter(dir_ + "/alpha", merged.config()));
  model::KVCache cache = model::KVCache::create(merged.config(), static_cast<int64_t>(prompt.size()));
  Tensor hidden;
  merged.forward(prompt, cache, true, &hidden);
  const int64_t H = merged.config().hidden_size, T = static_cast<int64_t>(prompt.size());
  ASSERT_EQ(static_cast<int64_t>(alpha.size()), H);
  double err = 0, moved = 0;
  for (int64_t j = 0; j < H; ++j) {
    double mean = 0;
    for (int64_t t = 0; t < T; ++t) mean += hidden.data<float>()[t * H + j];
    mean /= static_cast<double>(T);
    err = std::max(err, std::abs(alpha[j] - mean));
    moved = std::max(moved, std::abs(static_cast<double>(alpha[j]) - base[j]));
  }
  EXPECT_LT(err, 1e-4);
  EXPECT_GT(moved, 1e-3) << "the adapter changed nothing: the check could not fail";
}

TEST_F(MultiLoraServe, EachAdapterGivesItsMergedModelsGreedyTokens) {
  auto c = server_->client();
  const std::vector<int32_t> prompt = {5, 9, 20, 33, 7, 100, 41, 12, 250, 3, 77};
  const int64_t n = 12;
  const auto alpha = served_tokens(c, "alpha", prompt, n), beta = served_tokens(c, "beta", prompt, n),
             base = served_tokens(c, "serve_model", prompt, n);
  EXPECT_EQ(alpha, expected(dir_ + "/alpha", prompt, n));
  EXPECT_EQ(beta, expected(dir_ + "/beta", prompt, n));
  EXPECT_EQ(base, expected("", prompt, n));
  EXPECT_FALSE(alpha == base && beta == base) << "the adapters changed nothing: the check could not fail";
  // Non-streamed: the response names the adapter.
  auto r = c.Post("/v1/completions",
                  json({{"model", "beta"}, {"prompt", prompt}, {"max_tokens", 2}, {"temperature", 0}}).dump(),
                  "application/json");
  ASSERT_TRUE(r && r->status == 200);
  EXPECT_EQ(json::parse(r->body)["model"], "beta");
  // Requests per adapter in /metrics: beta's two, alpha's one so far in this test.
  auto m = c.Get("/metrics");
  ASSERT_TRUE(m && m->status == 200);
  EXPECT_NE(m->body.find("tessera_lora_requests_total{lora_name=\"beta\",model_name=\"serve_model\"} 2"),
            std::string::npos)
      << m->body;
}

TEST_F(MultiLoraServe, UnknownModelIsModelNotFound) {
  auto c = server_->client();
  auto r = c.Post("/v1/completions", json({{"model", "gamma"}, {"prompt", "hello"}, {"max_tokens", 2}}).dump(),
                  "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 404);  // as for any unknown model on this server (and on OpenAI's)
  const json e = json::parse(r->body)["error"];
  EXPECT_EQ(e["code"], "model_not_found");
  EXPECT_EQ(e["param"], "model");
  EXPECT_NE(e["message"].get<std::string>().find("'alpha', 'beta'"), std::string::npos) << e["message"];
}

TEST_F(MultiLoraServe, BadLoraFlagsAreOneLineErrors) {
  const std::string a = dir_ + "/alpha";
  const std::pair<std::string, std::string> cases[] = {
      {"--lora " + a, "expected NAME=ADAPTER_DIR"},
      {"--lora x=" + a + " --lora x=" + a, "the name is given twice"},
      {"--lora serve_model=" + a, "the name is the base model's"},
      {"--lora x=/nonexistent/adapter", "--lora x: "},
  };
  for (const auto& [args, needle] : cases) {
    const auto r = testing::run_command(std::string(TESSERA_CLI_PATH) + " serve --model " + kModel + " " + args);
    EXPECT_NE(r.code, 0) << args;
    EXPECT_NE(r.out.find(needle), std::string::npos) << args << ": " << r.out;
    EXPECT_LE(std::count(r.out.begin(), r.out.end(), '\n'), 1) << args << ": " << r.out;
  }
}

}  // namespace
}  // namespace tessera
