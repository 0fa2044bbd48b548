// The API extras against a real `tessera serve` process: GET /v1/models/{id} (ids with '/',
// 404 model_not_found, auth), POST /v1/embeddings (every input shape, float and base64,
// usage, 400s naming the param) with each embedding equal to the PyTorch reference's mean
// final-norm hidden state (tests/parity/serve_reference.py on the same model directory),
// completions echo / logprobs of the prompt and vLLM's prompt_logprobs equal to the
// reference's log_softmax, and logit_bias steering greedy decoding.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>

#include "serve/server_process.h"
#include "test_util/run_command.h"

namespace tessera {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using testing::ServerProcess;
using testing::sse_data;

const std::string kModel = TESSERA_SERVE_MODEL;
const std::string kName = "org/tessera-test";  // a served id with a '/', as hub ids have
const std::string kKey = "sk-extras";

// The PyTorch reference (float64) for each prompt: {"embedding", "prompt_logprobs", "top"}.
json reference(const std::vector<std::vector<int32_t>>& prompts) {
  const std::string base = (fs::temp_directory_path() / ("tessera_extras_" + std::to_string(::getpid()))).string();
  {
    std::ofstream(base + "_in.json") << json(prompts).dump();
  }
  const auto r = testing::run_command(std::string(TESSERA_PYTHON) + " " + TESSERA_SOURCE_DIR +
                                      "/tests/parity/serve_reference.py --model " + kModel + " --prompts " + base +
                                      "_in.json --out " + base + "_out.json");
  EXPECT_EQ(r.code, 0) << r.out;
  std::ifstream in(base + "_out.json");
  json out = json::parse(in);
  fs::remove(base + "_in.json");
  fs::remove(base + "_out.json");
  return out;
}

// Base64 (RFC 4648) to bytes, written here as the reference for the server's encoder.
std::string base64_decode(const std::string& s) {
  auto value = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    return c == '+' ? 62 : c == '/' ? 63 : -1;
  };
  std::string out;
  uint32_t acc = 0;
  int bits = 0;
  for (char c : s) {
    if (c == '=') break;
    const int v = value(c);
    if (v < 0) ADD_FAILURE() << "not base64: " << c;
    acc = (acc << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out += static_cast<char>((acc >> bits) & 0xff);
    }
  }
  return out;
}

std::vector<float> little_endian_f32(const std::string& bytes) {
  EXPECT_EQ(bytes.size() % 4, 0u);
  std::vector<float> v(bytes.size() / 4);
  for (size_t i = 0; i < v.size(); ++i) {
    uint32_t u = 0;
    for (int k = 0; k < 4; ++k) u |= static_cast<uint32_t>(static_cast<uint8_t>(bytes[i * 4 + k])) << (8 * k);
    std::memcpy(&v[i], &u, 4);
  }
  return v;
}

class ApiExtras : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    // f32 KV (what the reference computes in), small chunks so prompts prefill over steps.
    server_ = new ServerProcess({"--model", kModel, "--served-model-name", kName, "--api-key", kKey,
                                 "--kv-cache-dtype", "f32", "--block-size", "8", "--max-num-batched-tokens", "32"});
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  static httplib::Client client() {
    auto c = server_->client();
    c.set_bearer_token_auth(kKey);
    return c;
  }
  static json post_ok(httplib::Client& c, const std::string& path, const json& body) {
    auto r = c.Post(path, body.dump(), "application/json");
    EXPECT_TRUE(r);
    if (!r) return json();
    EXPECT_EQ(r->status, 200) << body.dump() << " -> " << r->body;
    return json::parse(r->body);
  }
  static std::vector<int32_t> tokenize(httplib::Client& c, const std::string& text) {
    return post_ok(c, "/tokenize", {{"prompt", text}})["tokens"].get<std::vector<int32_t>>();
  }
  static ServerProcess* server_;
};
ServerProcess* ApiExtras::server_ = nullptr;

TEST_F(ApiExtras, RetrieveModelById) {
  auto c = client();
  auto list = c.Get("/v1/models");
  ASSERT_TRUE(list && list->status == 200);
  const json listed = json::parse(list->body)["data"][0];
  auto r = c.Get("/v1/models/" + kName);
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const json m = json::parse(r->body);
  EXPECT_EQ(m, listed);  // the same card, created included
  EXPECT_EQ(m["id"], kName);
  EXPECT_EQ(m["object"], "model");
  EXPECT_EQ(m["owned_by"], "tessera");
  EXPECT_TRUE(m["parent"].is_null());
  EXPECT_EQ(m["max_model_len"], 512);
  const int64_t now = static_cast<int64_t>(std::time(nullptr));
  EXPECT_LE(m["created"].get<int64_t>(), now);
  EXPECT_GT(m["created"].get<int64_t>(), now - 3600);
  for (const std::string bad : {"nope", "org", "org/tessera-test/x", "serve_model"}) {
    r = c.Get("/v1/models/" + bad);
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 404) << bad;
    const json e = json::parse(r->body)["error"];
    EXPECT_EQ(e["code"], "model_not_found") << bad;
    EXPECT_EQ(e["type"], "invalid_request_error");
    EXPECT_NE(e["message"].get<std::string>().find(bad), std::string::npos);
  }
  auto anonymous = server_->client();  // no key: 401, as /v1/models
  r = anonymous.Get("/v1/models/" + kName);
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 401);
}

TEST_F(ApiExtras, EmbeddingsEqualThePyTorchMeanOfFinalNormHiddenStates) {
  auto c = client();
  const std::string text = "The quick brown fox jumps over the lazy dog.";
  const auto ids = tokenize(c, text), hello = tokenize(c, "Hello world!");
  std::vector<int32_t> full(512);  // the whole context
  for (size_t i = 0; i < full.size(); ++i) full[i] = static_cast<int32_t>((i * 7 + 3) % 380);
  const json ref = reference({ids, hello, {5}, full});
  auto expect_close = [&](const json& got, const json& want, const std::string& what) {
    ASSERT_EQ(got.size(), want.size()) << what;
    double err = 0, scale = 0;
    for (size_t j = 0; j < want.size(); ++j) {
      err = std::max(err, std::abs(got[j].get<double>() - want[j].get<double>()));
      scale = std::max(scale, std::abs(want[j].get<double>()));
    }
    EXPECT_LT(err, 1e-4 * std::max(1.0, scale)) << what;
  };
  // A string.
  json r = post_ok(c, "/v1/embeddings", {{"model", kName}, {"input", text}});
  EXPECT_EQ(r["object"], "list");
  EXPECT_EQ(r["model"], kName);
  ASSERT_EQ(r["data"].size(), 1u);
  EXPECT_EQ(r["data"][0]["object"], "embedding");
  EXPECT_EQ(r["data"][0]["index"], 0);
  expect_close(r["data"][0]["embedding"], ref[0]["embedding"], "string");
  EXPECT_EQ(r["usage"]["prompt_tokens"], ids.size());
  EXPECT_EQ(r["usage"]["total_tokens"], ids.size());
  const json text_embedding = r["data"][0]["embedding"];
  // A list of strings, token ids, a list of id lists (the whole context among them).
  r = post_ok(c, "/v1/embeddings", {{"input", {text, "Hello world!"}}, {"user", "u-1"}});
  ASSERT_EQ(r["data"].size(), 2u);
  // Batched with another input, its GEMMs have other row counts, whose last bits may differ
  // (oneDNN's AVX2 kernels do; docs/inference.md: only --batch-invariant promises bits).
  expect_close(r["data"][0]["embedding"], text_embedding, "the same input in a batch of two");
  expect_close(r["data"][1]["embedding"], ref[1]["embedding"], "list of strings [1]");
  EXPECT_EQ(r["data"][1]["index"], 1);
  EXPECT_EQ(r["usage"]["prompt_tokens"], ids.size() + hello.size());
  r = post_ok(c, "/v1/embeddings", {{"input", ids}});
  EXPECT_EQ(r["data"][0]["embedding"], text_embedding);
  r = post_ok(c, "/v1/embeddings", {{"input", {std::vector<int32_t>{5}, full, hello}}});
  ASSERT_EQ(r["data"].size(), 3u);
  expect_close(r["data"][0]["embedding"], ref[2]["embedding"], "one token");
  expect_close(r["data"][1]["embedding"], ref[3]["embedding"], "512 tokens");
  expect_close(r["data"][2]["embedding"], ref[1]["embedding"], "ids of 'Hello world!'");
  EXPECT_EQ(r["usage"]["prompt_tokens"], 1 + 512 + hello.size());
  // base64: the little-endian f32 bytes of the very same floats.
  r = post_ok(c, "/v1/embeddings", {{"input", text}, {"encoding_format", "base64"}});
  ASSERT_TRUE(r["data"][0]["embedding"].is_string());
  const auto decoded = little_endian_f32(base64_decode(r["data"][0]["embedding"]));
  ASSERT_EQ(decoded.size(), text_embedding.size());
  for (size_t j = 0; j < decoded.size(); ++j) EXPECT_EQ(decoded[j], text_embedding[j].get<float>()) << j;
  // dimensions equal to the hidden size is no change; the metrics saw the prompt tokens.
  r = post_ok(c, "/v1/embeddings", {{"input", text}, {"dimensions", text_embedding.size()}});
  EXPECT_EQ(r["data"][0]["embedding"], text_embedding);
}

TEST_F(ApiExtras, EmbeddingErrorsNameTheParam) {
  auto c = client();
  std::string long_text;
  for (int i = 0; i < 700; ++i) long_text += "token ";
  std::vector<int32_t> too_long(513, 5);
  json many = json::array();
  for (int i = 0; i < 2049; ++i) many.push_back("x");
  const std::vector<std::pair<json, std::string>> cases = {
      {json::object(), "input"},
      {{{"input", nullptr}}, "input"},
      {{{"input", 5}}, "input"},
      {{{"input", json::array()}}, "input"},
      {{{"input", ""}}, "input"},
      {{{"input", {"a", ""}}}, "input"},
      {{{"input", json::array({json::array()})}}, "input"},
      {{{"input", {1.5}}}, "input"},
      {{{"input", {1, -1}}}, "input"},
      {{{"input", {1, 100000}}}, "input"},
      {{{"input", {{1, 2}, 3}}}, "input"},
      {{{"input", {"a", {{"k", 1}}}}}, "input"},
      {{{"input", long_text}}, "input"},
      {{{"input", too_long}}, "input"},
      {{{"input", many}}, "input"},
      {{{"input", "hi"}, {"encoding_format", "hex"}}, "encoding_format"},
      {{{"input", "hi"}, {"encoding_format", 1}}, "encoding_format"},
      {{{"input", "hi"}, {"dimensions", 7}}, "dimensions"},
      {{{"input", "hi"}, {"dimensions", 0}}, "dimensions"},
      {{{"input", "hi"}, {"dimensions", "64"}}, "dimensions"},
      {{{"input", "hi"}, {"user", 5}}, "user"},
      {{{"input", "hi"}, {"model", 3}}, "model"},
  };
  for (const auto& [body, param] : cases) {
    auto r = c.Post("/v1/embeddings", body.dump(), "application/json");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 400) << body.dump().substr(0, 200) << " -> " << r->body;
    const json e = json::parse(r->body)["error"];
    EXPECT_EQ(e["param"], param) << body.dump().substr(0, 200) << " -> " << r->body;
    EXPECT_EQ(e["type"], "invalid_request_error");
  }
  auto r = c.Post("/v1/embeddings", "{not json", "application/json");
  EXPECT_EQ(r->status, 400);
  r = c.Post("/v1/embeddings", json({{"input", too_long}}).dump(), "application/json");
  EXPECT_EQ(json::parse(r->body)["error"]["code"], "context_length_exceeded");
  r = c.Post("/v1/embeddings", json({{"input", "hi"}, {"model", "nope"}}).dump(), "application/json");
  EXPECT_EQ(r->status, 404);
  EXPECT_EQ(json::parse(r->body)["error"]["code"], "model_not_found");
}

TEST_F(ApiExtras, EchoWithLogprobsScoresThePromptAsPyTorch) {
  auto c = client();
  const std::string prompt = "To be or not to be, that is the question.";
  const auto ids = tokenize(c, prompt);
  const size_t P = ids.size();
  ASSERT_GT(P, 5u);
  const json ref = reference({ids})[0];
  const json base = {{"model", kName}, {"prompt", prompt}, {"max_tokens", 4}, {"temperature", 0},
                     {"ignore_eos", true}};
  const json plain = post_ok(c, "/v1/completions", base);
  json body = base;
  body["echo"] = true;
  body["logprobs"] = 3;
  const json r = post_ok(c, "/v1/completions", body);
  const json& ch = r["choices"][0];
  EXPECT_EQ(ch["text"], prompt + plain["choices"][0]["text"].get<std::string>());
  EXPECT_EQ(r["usage"]["prompt_tokens"], P);
  EXPECT_EQ(r["usage"]["completion_tokens"], 4);
  EXPECT_FALSE(ch.contains("prompt_logprobs")) << "only when prompt_logprobs is asked for, as vLLM";
  const json& lp = ch["logprobs"];
  ASSERT_EQ(lp["tokens"].size(), P + 4);
  ASSERT_EQ(lp["token_logprobs"].size(), P + 4);
  EXPECT_TRUE(lp["token_logprobs"][0].is_null()) << "nothing precedes the first token";
  EXPECT_TRUE(lp["top_logprobs"][0].is_null());
  for (size_t i = 1; i < P; ++i) {
    EXPECT_NEAR(lp["token_logprobs"][i].get<double>(), ref["prompt_logprobs"][i - 1].get<double>(), 1e-4) << i;
    const json& top = lp["top_logprobs"][i];
    ASSERT_EQ(top.size(), 3u) << i;
    std::vector<double> got, want;
    for (const auto& [k, v] : top.items()) got.push_back(v.get<double>());
    for (int k = 0; k < 3; ++k) want.push_back(ref["top"][i - 1][k][1].get<double>());
    std::sort(got.rbegin(), got.rend());
    for (int k = 0; k < 3; ++k) EXPECT_NEAR(got[k], want[k], 1e-4) << i;
  }
  for (size_t i = P; i < P + 4; ++i) EXPECT_TRUE(lp["token_logprobs"][i].is_number()) << i;
  // text_offset: the prompt's tokens from 0, the completion's from the prompt's length.
  EXPECT_EQ(lp["text_offset"][0], 0);
  EXPECT_EQ(lp["text_offset"][P], prompt.size());
  for (size_t i = 1; i < P + 4; ++i) EXPECT_GE(lp["text_offset"][i], lp["text_offset"][i - 1]);

  // Streaming: the prompt arrives first, then the completion; the same text in the end.
  body["stream"] = true;
  auto s = c.Post("/v1/completions", body.dump(), "application/json");
  ASSERT_TRUE(s && s->status == 200);
  const auto events = sse_data(s->body);
  ASSERT_GE(events.size(), 3u);
  const json first = json::parse(events[0]);
  EXPECT_EQ(first["choices"][0]["text"], prompt);
  EXPECT_EQ(first["choices"][0]["logprobs"]["tokens"].size(), P);
  EXPECT_EQ(first["choices"][0]["token_ids"], ids);
  std::string text;
  for (const auto& e : events)
    if (e != "[DONE]") text += json::parse(e)["choices"][0]["text"].get<std::string>();
  EXPECT_EQ(text, ch["text"]);

  // max_tokens 0 with echo: the prompt alone, scored (the legacy OpenAI idiom), streamed too.
  json only = {{"prompt", prompt}, {"max_tokens", 0}, {"echo", true}, {"logprobs", 1}};
  const json scored = post_ok(c, "/v1/completions", only);
  EXPECT_EQ(scored["choices"][0]["text"], prompt);
  EXPECT_EQ(scored["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(scored["usage"]["completion_tokens"], 0);
  ASSERT_EQ(scored["choices"][0]["logprobs"]["token_logprobs"].size(), P);
  for (size_t i = 1; i < P; ++i)
    EXPECT_NEAR(scored["choices"][0]["logprobs"]["token_logprobs"][i].get<double>(),
                ref["prompt_logprobs"][i - 1].get<double>(), 1e-4) << i;
  only["stream"] = true;
  s = c.Post("/v1/completions", only.dump(), "application/json");
  ASSERT_TRUE(s && s->status == 200);
  const auto only_events = sse_data(s->body);
  ASSERT_EQ(only_events.size(), 3u) << s->body;  // the prompt, the end, [DONE]
  EXPECT_EQ(json::parse(only_events[0])["choices"][0]["text"], prompt);
  EXPECT_EQ(json::parse(only_events[1])["choices"][0]["text"], "");
  EXPECT_EQ(json::parse(only_events[1])["choices"][0]["finish_reason"], "length");
  for (const json& bad : {json({{"prompt", prompt}, {"max_tokens", 0}}),
                          json({{"prompt", prompt}, {"max_tokens", 0}, {"echo", false}})}) {
    auto e = c.Post("/v1/completions", bad.dump(), "application/json");
    EXPECT_EQ(e->status, 400);
    EXPECT_EQ(json::parse(e->body)["error"]["param"], "max_tokens");
  }

  // A token-id prompt echoes its detokenized text; n = 2 samples both start with it.
  json ids_body = {{"prompt", ids}, {"max_tokens", 3}, {"echo", true}, {"n", 2}, {"temperature", 1}, {"seed", 5},
                   {"ignore_eos", true}};
  const json two = post_ok(c, "/v1/completions", ids_body);
  ASSERT_EQ(two["choices"].size(), 2u);
  for (const auto& choice : two["choices"])
    EXPECT_EQ(choice["text"].get<std::string>().substr(0, prompt.size()), prompt);
  ids_body["echo"] = false;
  const json two_plain = post_ok(c, "/v1/completions", ids_body);
  for (size_t k = 0; k < 2; ++k)
    EXPECT_EQ(two["choices"][k]["text"], prompt + two_plain["choices"][k]["text"].get<std::string>());
}

TEST_F(ApiExtras, PromptLogprobsInVllmsShape) {
  auto c = client();
  const std::string prompt = "All that glitters is not gold.";
  const auto ids = tokenize(c, prompt);
  const json ref = reference({ids})[0];
  const json r = post_ok(c, "/v1/completions", {{"prompt", prompt}, {"max_tokens", 2}, {"prompt_logprobs", 2},
                                                {"ignore_eos", true}});
  const json& pl = r["choices"][0]["prompt_logprobs"];
  ASSERT_EQ(pl.size(), ids.size());
  EXPECT_TRUE(pl[0].is_null());
  EXPECT_TRUE(r["choices"][0]["logprobs"].is_null());
  for (size_t i = 1; i < ids.size(); ++i) {
    const json& d = pl[i];
    const std::string key = std::to_string(ids[i]);
    ASSERT_TRUE(d.contains(key)) << i << ": " << d.dump();
    EXPECT_NEAR(d[key]["logprob"].get<double>(), ref["prompt_logprobs"][i - 1].get<double>(), 1e-4) << i;
    EXPECT_GE(d[key]["rank"].get<int64_t>(), 1);
    EXPECT_TRUE(d[key]["decoded_token"].is_string());
    for (int k = 0; k < 2; ++k) {  // the two most likely tokens, ranks 1 and 2
      const std::string top = std::to_string(ref["top"][i - 1][k][0].get<int64_t>());
      ASSERT_TRUE(d.contains(top)) << i << ": " << d.dump();
      EXPECT_EQ(d[top]["rank"], k + 1);
      EXPECT_NEAR(d[top]["logprob"].get<double>(), ref["top"][i - 1][k][1].get<double>(), 1e-4);
    }
    EXPECT_LE(d.size(), 3u);
  }
  // Chat: the response's prompt_logprobs cover the rendered prompt.
  const json chat = post_ok(c, "/v1/chat/completions", {{"messages", {{{"role", "user"}, {"content", "Hi"}}}},
                                                        {"max_tokens", 2}, {"prompt_logprobs", 0}});
  const auto chat_ids = post_ok(c, "/tokenize", {{"messages", {{{"role", "user"}, {"content", "Hi"}}}}})["tokens"];
  ASSERT_EQ(chat["prompt_logprobs"].size(), chat_ids.size());
  EXPECT_TRUE(chat["prompt_logprobs"][0].is_null());
  EXPECT_EQ(chat["prompt_logprobs"][1].size(), 1u);  // the prompt token alone
  // echo is a completions feature.
  auto bad = c.Post("/v1/chat/completions",
                    json({{"messages", {{{"role", "user"}, {"content", "Hi"}}}}, {"echo", true}}).dump(),
                    "application/json");
  EXPECT_EQ(bad->status, 400);
  EXPECT_EQ(json::parse(bad->body)["error"]["param"], "echo");
}

TEST_F(ApiExtras, LogitBiasSteersGreedyDecoding) {
  auto c = client();
  const json base = {{"prompt", "Hello world!"}, {"max_tokens", 5}, {"temperature", 0}, {"ignore_eos", true}};
  // The streamed token ids tell which tokens were picked.
  auto tokens_of = [&](json body) {
    body["stream"] = true;
    auto r = c.Post("/v1/completions", body.dump(), "application/json");
    EXPECT_TRUE(r && r->status == 200);
    std::vector<int32_t> out;
    for (const auto& e : sse_data(r->body)) {
      if (e == "[DONE]") continue;
      const json chunk = json::parse(e);
      for (const auto& t : chunk["choices"][0]["token_ids"]) out.push_back(t.get<int32_t>());
    }
    return out;
  };
  const auto greedy = tokens_of(base);
  ASSERT_EQ(greedy.size(), 5u);
  json up = base;
  up["logit_bias"] = {{"200", 100}};
  EXPECT_EQ(tokens_of(up), std::vector<int32_t>(5, 200)) << "+100 makes token 200 the greedy choice";
  json down = base;
  down["logit_bias"] = {{std::to_string(greedy[0]), -100}};
  EXPECT_NE(tokens_of(down)[0], greedy[0]) << "-100 bans the greedy first token";
  // Chat too.
  json chat = {{"messages", {{{"role", "user"}, {"content", "Hi"}}}}, {"max_tokens", 3}, {"temperature", 0},
               {"ignore_eos", true}, {"stream", true}, {"logit_bias", {{"77", 100}}}};
  auto r = c.Post("/v1/chat/completions", chat.dump(), "application/json");
  ASSERT_TRUE(r && r->status == 200);
  std::vector<int32_t> got;
  for (const auto& e : sse_data(r->body)) {
    if (e == "[DONE]") continue;
    const json chunk = json::parse(e);
    for (const auto& ch : chunk["choices"])
      if (ch.contains("token_ids"))
        for (const auto& t : ch["token_ids"]) got.push_back(t.get<int32_t>());
  }
  EXPECT_EQ(got, std::vector<int32_t>(3, 77));
  for (const json& bad : {json({{"abc", 1}}), json({{"5", 101}}), json({{"5", "x"}}), json({{"384", 1}}),
                          json({{"-2", 1}}), json::array({1})}) {
    json b = base;
    b["logit_bias"] = bad;
    auto e = c.Post("/v1/completions", b.dump(), "application/json");
    ASSERT_TRUE(e);
    EXPECT_EQ(e->status, 400) << bad.dump();
    EXPECT_EQ(json::parse(e->body)["error"]["param"], "logit_bias") << bad.dump() << " -> " << e->body;
  }
}

// `tessera generate --input`: request lines take logit_bias through the same parser.
TEST(GenerateInput, LogitBiasFromRequestLines) {
  const std::string base = (fs::temp_directory_path() / ("tessera_gen_bias_" + std::to_string(::getpid()))).string();
  {
    std::ofstream in(base + ".jsonl");
    in << R"({"id": "plain", "prompt_ids": [5, 9, 20], "max_tokens": 4, "ignore_eos": true})" << "\n"
       << R"({"id": "biased", "prompt_ids": [5, 9, 20], "max_tokens": 4, "ignore_eos": true, "logit_bias": {"123": 100}})"
       << "\n";
  }
  auto r = testing::run_cli("generate --model " + kModel + " --input " + base + ".jsonl --output " + base + ".out");
  ASSERT_EQ(r.code, 0) << r.out;
  std::ifstream out(base + ".out");
  std::map<std::string, std::vector<int32_t>> got;
  for (std::string line; std::getline(out, line);) {
    const json j = json::parse(line);
    got[j["id"]] = j["outputs"][0]["token_ids"].get<std::vector<int32_t>>();
  }
  EXPECT_EQ(got["biased"], std::vector<int32_t>(4, 123));
  EXPECT_NE(got["plain"], got["biased"]);
  {
    std::ofstream in(base + ".jsonl");
    in << R"({"prompt_ids": [5, 9], "logit_bias": {"5": 1000}})" << "\n";
  }
  r = testing::run_cli("generate --model " + kModel + " --input " + base + ".jsonl --output " + base + ".out");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("logit_bias"), std::string::npos) << r.out;
  {
    std::ofstream in(base + ".jsonl");
    in << R"({"prompt_ids": [5, 9], "logit_bias": {"384": 1}})" << "\n";  // the vocabulary is 384
  }
  r = testing::run_cli("generate --model " + kModel + " --input " + base + ".jsonl --output " + base + ".out");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("logit_bias"), std::string::npos) << r.out;
  fs::remove(base + ".jsonl");
  fs::remove(base + ".out");
}

}  // namespace
}  // namespace tessera
