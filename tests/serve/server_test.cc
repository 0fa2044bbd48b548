// Protocol tests against a real `tessera serve` process on loopback: every endpoint, the
// OpenAI schemas, SSE framing, usage counts, a table of bad requests, auth, 429 under a
// flood, cancellation on disconnect, timeouts, body limits and the SIGTERM drain.
#include <gtest/gtest.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <cctype>
#include <set>

#include "serve/server_process.h"
#include "test_util/run_command.h"

namespace tessera {
namespace {

using nlohmann::json;
using testing::ServerProcess;
using testing::sse_data;

const std::string kModel = TESSERA_SERVE_MODEL;
// The tiny model steps in well under a millisecond; 5 ms steps give cancellation, timeouts and
// drains something to interrupt.
const std::string kSlow = "TESSERA_SERVE_STEP_DELAY_MS=5";

httplib::Result post(httplib::Client& c, const std::string& path, const json& body,
                     const httplib::Headers& h = {}) {
  return c.Post(path, h, body.dump(), "application/json");
}

// One server for the read-only protocol tests (started once; each test is independent).
class Serve : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    server_ = new ServerProcess({"--model", kModel, "--max-num-batched-tokens", "64", "--block-size", "8"});
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  static ServerProcess* server_;
};
ServerProcess* Serve::server_ = nullptr;

std::vector<int32_t> tokenize(httplib::Client& c, const std::string& text) {
  auto r = post(c, "/tokenize", {{"prompt", text}});
  EXPECT_TRUE(r && r->status == 200);
  return json::parse(r->body)["tokens"].get<std::vector<int32_t>>();
}

TEST_F(Serve, ModelsHealthMetricsStatsAndPage) {
  auto c = server_->client();
  auto r = c.Get("/v1/models");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  const json m = json::parse(r->body);
  EXPECT_EQ(m["object"], "list");
  EXPECT_EQ(m["data"][0]["id"], "serve_model");
  EXPECT_EQ(m["data"][0]["object"], "model");
  EXPECT_EQ(m["data"][0]["max_model_len"], 512);
  EXPECT_EQ(m["data"][0]["chat_template"], "model");
  r = c.Get("/health");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  r = c.Get("/metrics");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  for (const char* name :
       {"tessera_time_to_first_token_seconds_bucket", "tessera_inter_token_latency_seconds_bucket",
        "tessera_e2e_request_latency_seconds_bucket", "tessera_request_queue_time_seconds_bucket",
        "tessera_prompt_tokens_total", "tessera_generation_tokens_total", "tessera_prefix_cache_queries_total",
        "tessera_prefix_cache_hits_total", "tessera_num_preemptions_total",
        "tessera_spec_decode_num_draft_tokens_total", "tessera_spec_decode_num_accepted_tokens_total",
        "tessera_num_requests_running", "tessera_num_requests_waiting", "tessera_kv_cache_usage_perc"})
    EXPECT_NE(r->body.find(name), std::string::npos) << name;
  const json s = server_->stats();
  EXPECT_GT(s["kv_blocks_total"].get<int64_t>(), 0);
  for (const char* k : {"running", "waiting", "kv_usage", "generation_tokens_per_s", "generation_tokens_total"})
    EXPECT_TRUE(s.contains(k)) << k;
  r = c.Get("/");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  EXPECT_NE(r->get_header_value("Content-Type").find("text/html"), std::string::npos);
  EXPECT_NE(r->body.find("/v1/chat/completions"), std::string::npos);
  r = c.Get("/nope");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 404);
  EXPECT_TRUE(json::parse(r->body)["error"].contains("message"));
}

TEST_F(Serve, TokenizeDetokenizeRoundTrip) {
  auto c = server_->client();
  const std::string text = "Hello world! Caf\xc3\xa9 2026";
  const auto ids = tokenize(c, text);
  ASSERT_FALSE(ids.empty());
  auto r = post(c, "/detokenize", {{"tokens", ids}});
  ASSERT_TRUE(r && r->status == 200);
  EXPECT_EQ(json::parse(r->body)["prompt"], text);
  // messages: the chat template's text, tokenized without extra specials.
  r = post(c, "/tokenize", {{"messages", {{{"role", "user"}, {"content", "Hi"}}}}});
  ASSERT_TRUE(r && r->status == 200);
  const auto chat_ids = json::parse(r->body)["tokens"].get<std::vector<int32_t>>();
  r = post(c, "/detokenize", {{"tokens", chat_ids}});
  EXPECT_EQ(json::parse(r->body)["prompt"], "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
}

TEST_F(Serve, CompletionUsageAndGreedyMatchesGenerate) {
  auto c = server_->client();
  const std::string prompt = "The quick brown fox";
  const auto ids = tokenize(c, prompt);
  auto r = post(c, "/v1/completions",
                {{"model", "serve_model"}, {"prompt", prompt}, {"max_tokens", 12}, {"temperature", 0},
                 {"ignore_eos", true}, {"user", "test"}});
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const json j = json::parse(r->body);
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_EQ(j["model"], "serve_model");
  EXPECT_EQ(j["choices"].size(), 1u);
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(j["usage"]["prompt_tokens"], ids.size());
  EXPECT_EQ(j["usage"]["completion_tokens"], 12);
  EXPECT_EQ(j["usage"]["total_tokens"], ids.size() + 12);
  // The same greedy tokens as `tessera generate` on the same prompt ids (streamed token_ids).
  auto st = post(c, "/v1/completions",
                 {{"prompt", ids}, {"max_tokens", 12}, {"temperature", 0}, {"ignore_eos", true}, {"stream", true}});
  ASSERT_TRUE(st && st->status == 200);
  std::vector<int32_t> served;
  for (const auto& e : sse_data(st->body)) {
    if (e == "[DONE]") continue;
    const json chunk = json::parse(e);
    for (const auto& t : chunk["choices"][0]["token_ids"]) served.push_back(t.get<int32_t>());
  }
  ASSERT_EQ(served.size(), 12u);
  std::string id_list;
  for (auto t : ids) id_list += (id_list.empty() ? "" : ",") + std::to_string(t);
  const auto g = testing::run_command(std::string(TESSERA_CLI_PATH) + " generate --model " + kModel +
                                          " --prompt-ids " + id_list + " --max-tokens 12 2>/dev/null",
                                      false);
  ASSERT_EQ(g.code, 0) << g.out;
  std::vector<int32_t> gen;
  std::stringstream ss(g.out);
  for (std::string item; std::getline(ss, item, ',');) gen.push_back(std::stoi(item));
  ASSERT_FALSE(gen.empty());
  // generate stops at EOS (not part of its output); the server ignored EOS here.
  EXPECT_EQ(std::vector<int32_t>(served.begin(), served.begin() + gen.size()), gen);
}

TEST_F(Serve, BatchedPromptsAndN) {
  auto c = server_->client();
  auto r = post(c, "/v1/completions",
                {{"prompt", json::array({"one", "two two", "three three three"})}, {"max_tokens", 3},
                 {"n", 2}, {"temperature", 0.8}, {"seed", 5}, {"ignore_eos", true}});
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const json j = json::parse(r->body);
  ASSERT_EQ(j["choices"].size(), 6u);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(j["choices"][i]["index"], i);
  EXPECT_EQ(j["usage"]["completion_tokens"], 18);
  int64_t prompt = 0;
  for (const char* p : {"one", "two two", "three three three"}) prompt += static_cast<int64_t>(tokenize(c, p).size());
  EXPECT_EQ(j["usage"]["prompt_tokens"], prompt);
  // Seeded: the same request gives the same text.
  auto r2 = post(c, "/v1/completions",
                 {{"prompt", json::array({"one", "two two", "three three three"})}, {"max_tokens", 3},
                  {"n", 2}, {"temperature", 0.8}, {"seed", 5}, {"ignore_eos", true}});
  const json j2 = json::parse(r2->body);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(j2["choices"][i]["text"], j["choices"][i]["text"]);
}

TEST_F(Serve, StreamingFramingMatchesFullResponse) {
  auto c = server_->client();
  const json req = {{"prompt", "Hello world"}, {"max_tokens", 10}, {"temperature", 0}, {"ignore_eos", true}};
  auto full = post(c, "/v1/completions", req);
  ASSERT_TRUE(full && full->status == 200);
  json sreq = req;
  sreq["stream"] = true;
  sreq["stream_options"] = {{"include_usage", true}};
  auto r = post(c, "/v1/completions", sreq);
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200);
  EXPECT_NE(r->get_header_value("Content-Type").find("text/event-stream"), std::string::npos);
  // Every event is "data: ...\n\n".
  EXPECT_EQ(r->body.rfind("data: [DONE]\n\n"), r->body.size() - 14);
  const auto events = sse_data(r->body);
  ASSERT_GE(events.size(), 3u);
  EXPECT_EQ(events.back(), "[DONE]");
  std::string text;
  int token_chunks = 0;
  for (size_t i = 0; i + 2 < events.size(); ++i) {
    const json ch = json::parse(events[i]);
    EXPECT_EQ(ch["object"], "text_completion");
    EXPECT_TRUE(ch.contains("usage") && ch["usage"].is_null());
    text += ch["choices"][0]["text"].get<std::string>();
    token_chunks += !ch["choices"][0]["token_ids"].empty();
    if (i + 3 == events.size()) EXPECT_EQ(ch["choices"][0]["finish_reason"], "length");
    else EXPECT_TRUE(ch["choices"][0]["finish_reason"].is_null());
  }
  EXPECT_EQ(token_chunks, 10);  // one chunk per token group (one token a step here)
  EXPECT_EQ(text, json::parse(full->body)["choices"][0]["text"]);
  const json usage = json::parse(events[events.size() - 2]);
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_EQ(usage["usage"]["completion_tokens"], 10);
  EXPECT_EQ(usage["usage"], json::parse(full->body)["usage"]);
}

TEST_F(Serve, ChatFullAndStreaming) {
  auto c = server_->client();
  const json msgs = {{{"role", "system"}, {"content", "You are terse."}},
                     {{"role", "user"}, {"content", "Hello"}},
                     {{"role", "assistant"}, {"content", "Hi."}},
                     {{"role", "user"}, {"content", [] {
                        return json::array({{{"type", "text"}, {"text", "How are "}}, {{"type", "text"}, {"text", "you?"}}});
                      }()}}};
  auto r = post(c, "/v1/chat/completions", {{"messages", msgs}, {"max_completion_tokens", 6}, {"temperature", 0}});
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const json j = json::parse(r->body);
  EXPECT_EQ(j["object"], "chat.completion");
  EXPECT_EQ(j["choices"][0]["message"]["role"], "assistant");
  EXPECT_TRUE(j["choices"][0]["message"]["content"].is_string());
  EXPECT_LE(j["usage"]["completion_tokens"].get<int>(), 6);
  // The prompt is the ChatML rendering of the messages.
  auto t = post(c, "/tokenize", {{"messages", msgs}});
  EXPECT_EQ(j["usage"]["prompt_tokens"], json::parse(t->body)["count"]);

  auto s = post(c, "/v1/chat/completions",
                {{"messages", msgs}, {"max_tokens", 6}, {"temperature", 0}, {"stream", true}});
  ASSERT_TRUE(s && s->status == 200);
  const auto events = sse_data(s->body);
  ASSERT_GE(events.size(), 3u);
  const json first = json::parse(events[0]);
  EXPECT_EQ(first["object"], "chat.completion.chunk");
  EXPECT_EQ(first["choices"][0]["delta"]["role"], "assistant");
  std::string text;
  for (size_t i = 1; i + 1 < events.size(); ++i) {
    const json ch = json::parse(events[i]);
    text += ch["choices"][0]["delta"].value("content", "");
  }
  EXPECT_EQ(text, j["choices"][0]["message"]["content"]);
  EXPECT_EQ(json::parse(events[events.size() - 2])["choices"][0]["finish_reason"],
            j["choices"][0]["finish_reason"]);
}

TEST_F(Serve, PrefixCacheCountsCachedTokens) {
  auto c = server_->client();
  std::string prompt;
  for (int i = 0; i < 12; ++i) prompt += "A journey of a thousand miles begins with a single step. ";
  const json req = {{"prompt", prompt}, {"max_tokens", 2}, {"temperature", 0}};
  auto a = post(c, "/v1/completions", req);
  auto b = post(c, "/v1/completions", req);
  ASSERT_TRUE(a && b && a->status == 200 && b->status == 200);
  const int64_t n = json::parse(b->body)["usage"]["prompt_tokens"];
  const int64_t cached = json::parse(b->body)["usage"]["prompt_tokens_details"]["cached_tokens"];
  EXPECT_GT(cached, 0);
  EXPECT_EQ(cached % 8, 0);  // whole blocks of 8
  EXPECT_LT(cached, n);
  EXPECT_GE(cached, n - 8);
}

TEST_F(Serve, LogprobsShapes) {
  auto c = server_->client();
  auto r = post(c, "/v1/completions", {{"prompt", "Hello"}, {"max_tokens", 4}, {"logprobs", 3}, {"ignore_eos", true}});
  ASSERT_TRUE(r && r->status == 200) << (r ? r->body : "");
  const json lp = json::parse(r->body)["choices"][0]["logprobs"];
  ASSERT_EQ(lp["tokens"].size(), 4u);
  ASSERT_EQ(lp["token_logprobs"].size(), 4u);
  ASSERT_EQ(lp["text_offset"].size(), 4u);
  for (const auto& top : lp["top_logprobs"]) {
    EXPECT_LE(top.size(), 3u);
    EXPECT_GE(top.size(), 1u);
    for (auto it = top.begin(); it != top.end(); ++it) EXPECT_LE(it.value().get<double>(), 0.0);
  }
  r = post(c, "/v1/chat/completions",
           {{"messages", {{{"role", "user"}, {"content", "Hi"}}}}, {"max_tokens", 3}, {"logprobs", true},
            {"top_logprobs", 2}, {"ignore_eos", true}});
  ASSERT_TRUE(r && r->status == 200) << (r ? r->body : "");
  const json content = json::parse(r->body)["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(content.size(), 3u);
  for (const auto& e : content) {
    EXPECT_TRUE(e["token"].is_string());
    EXPECT_LE(e["logprob"].get<double>(), 0.0);
    EXPECT_TRUE(e["bytes"].is_array());
    EXPECT_EQ(e["top_logprobs"].size(), 2u);
    // The top alternatives are sorted and the best is at least the chosen token's (greedy: equal).
    EXPECT_GE(e["top_logprobs"][0]["logprob"].get<double>(), e["top_logprobs"][1]["logprob"].get<double>());
  }
}

TEST_F(Serve, StopStringEndsWithStop) {
  auto c = server_->client();
  const json base = {{"prompt", "The weather is"}, {"max_tokens", 24}, {"temperature", 0}, {"ignore_eos", true}};
  auto r = post(c, "/v1/completions", base);
  ASSERT_TRUE(r && r->status == 200);
  const std::string text = json::parse(r->body)["choices"][0]["text"];
  ASSERT_GE(text.size(), 8u);
  // Stop on a piece from the middle of the greedy text (plain ASCII letters, so it is whole
  // UTF-8): the output is what came before it.
  size_t at = text.size() / 3;
  while (at + 2 < text.size() && !(std::isalpha(static_cast<unsigned char>(text[at])) &&
                                   std::isalpha(static_cast<unsigned char>(text[at + 1]))))
    ++at;
  ASSERT_LT(at + 2, text.size()) << text;
  const std::string stop = text.substr(at, 2);
  json req = base;
  req["stop"] = json::array({stop, "never-appears"});
  r = post(c, "/v1/completions", req);
  ASSERT_TRUE(r && r->status == 200);
  const json j = json::parse(r->body);
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(j["choices"][0]["text"], text.substr(0, text.find(stop)));
}

// At least 30 malformed requests: each a 400 (or the named status) whose error names the field.
// An unknown field near a known one is a typo: 400 with the suggestion. Other unknown
// fields are ignored, as OpenAI and vLLM ignore them.
TEST_F(Serve, MisspeltFieldsGetASuggestionOtherUnknownFieldsAreIgnored) {
  auto c = server_->client();
  auto r = c.Post("/v1/completions", R"({"prompt": "hi", "max_token": 3})", "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 400);
  EXPECT_NE(r->body.find("did you mean 'max_tokens'?"), std::string::npos) << r->body;
  r = c.Post("/v1/completions", R"({"prompt": "hi", "max_tokens": 2, "x_my_extension": {"a": 1}})", "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200) << r->body;
}

TEST_F(Serve, BadRequestsGetOpenAIErrorsNamingTheField) {
  auto c = server_->client();
  struct Case {
    std::string path, body, param;
    int status = 400;
  };
  const std::string C = "/v1/completions", H = "/v1/chat/completions";
  std::string long_prompt;
  for (int i = 0; i < 200; ++i) long_prompt += "server model token stream ";
  const std::vector<Case> cases = {
      {C, "{not json", ""},
      {C, "[1, 2]", ""},
      {C, R"({"prompt": "hi", "model": "gpt-4"})", "model", 404},  // model_not_found, as on OpenAI
      {H, R"({"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4"})", "model", 404},
      {C, R"({"prompt": "hi", "model": 3})", "model"},
      {C, R"({})", "prompt"},
      {C, R"({"prompt": ""})", "prompt"},
      {C, R"({"prompt": []})", "prompt"},
      {C, R"({"prompt": 5})", "prompt"},
      {C, R"({"prompt": [1, 99999]})", "prompt"},
      {C, R"({"prompt": [1, -3]})", "prompt"},
      {C, R"({"prompt": [[1, 2], {"a": 1}]})", "prompt"},
      {C, R"({"prompt": "hi", "max_tokens": -1})", "max_tokens"},
      // Misspelt fields (issue 22: silently ignored): the field named, with the suggestion.
      {C, R"({"prompt": "hi", "max_token": 3})", "max_token"},
      {C, R"({"prompt": "hi", "logprob": 2})", "logprob"},
      {H, R"({"messages": [{"role": "user", "content": "x"}], "temprature": 0.5})", "temprature"},
      {C, R"({"prompt": "hi", "max_tokens": 0})", "max_tokens"},
      {C, R"({"prompt": "hi", "max_tokens": "10"})", "max_tokens"},
      {C, R"({"prompt": "hi", "max_tokens": 1000000})", "max_tokens"},
      {C, R"({"prompt": "hi", "max_tokens": 99999999999999999999})", "max_tokens"},
      {C, R"({"prompt": "hi", "temperature": -0.5})", "temperature"},
      {C, R"({"prompt": "hi", "temperature": "hot"})", "temperature"},
      {C, R"({"prompt": "hi", "top_p": 0})", "top_p"},
      {C, R"({"prompt": "hi", "top_p": 1.5})", "top_p"},
      {C, R"({"prompt": "hi", "n": 0})", "n"},
      {C, R"({"prompt": "hi", "n": 100000, "temperature": 1})", "n"},
      {C, R"({"prompt": "hi", "n": 2, "temperature": 0})", "n"},
      {C, R"({"prompt": "hi", "presence_penalty": 3})", "presence_penalty"},
      {C, R"({"prompt": "hi", "frequency_penalty": -2.5})", "frequency_penalty"},
      {C, R"({"prompt": "hi", "repetition_penalty": 0})", "repetition_penalty"},
      {C, R"({"prompt": "hi", "top_k": -5})", "top_k"},
      {C, R"({"prompt": "hi", "min_p": 2})", "min_p"},
      {C, R"({"prompt": "hi", "seed": -1})", "seed"},
      {C, R"({"prompt": "hi", "seed": 1.5})", "seed"},
      {C, R"({"prompt": "hi", "stop": 7})", "stop"},
      {C, R"({"prompt": "hi", "stop": [""]})", "stop"},
      {C, R"({"prompt": "hi", "logprobs": 50})", "logprobs"},
      {C, R"({"prompt": "hi", "logprobs": true})", "logprobs"},
      {C, R"({"prompt": "hi", "stream": "yes"})", "stream"},
      {C, R"({"prompt": "hi", "stream_options": {"include_usage": true}})", "stream_options"},
      {C, R"({"prompt": "hi", "echo": "yes"})", "echo"},
      {C, R"({"prompt": "hi", "user": 12})", "user"},
      {C, "{\"prompt\": \"" + long_prompt + "\"}", "prompt"},
      {C, "{\"prompt\": \"bad \xff\xfe bytes\"}", "prompt"},
      {H, R"({"messages": []})", "messages"},
      {H, R"({})", "messages"},
      {H, R"({"messages": "hello"})", "messages"},
      {H, R"({"messages": [{"content": "hi"}]})", "messages[0].role"},
      {H, R"({"messages": [{"role": "wizard", "content": "hi"}]})", "messages[0].role"},
      {H, R"({"messages": [{"role": "user"}]})", "messages[0].content"},
      {H, R"({"messages": [{"role": "user", "content": 5}]})", "messages[0].content"},
      {H, R"({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})", "messages[0].content[0]"},
      {H, R"({"messages": [{"role": "user", "content": "hi"}], "logprobs": 3})", "logprobs"},
      {H, R"({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2})", "top_logprobs"},
      {H, R"({"messages": [{"role": "user", "content": "hi"}], "logprobs": true, "top_logprobs": 30})",
       "top_logprobs"},
      {H, R"({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 100000})",
       "max_completion_tokens"},
      {H, R"({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]})", "tools[0].function"},
      {H, "{\"messages\": [{\"role\": \"user\", \"content\": \"\xc3\x28\"}]}", "content"},
  };
  ASSERT_GE(cases.size(), 30u);
  for (const auto& k : cases) {
    auto r = c.Post(k.path, k.body, "application/json");
    ASSERT_TRUE(r) << k.body;
    EXPECT_EQ(r->status, k.status) << k.body << " -> " << r->body;
    json e;
    ASSERT_NO_THROW(e = json::parse(r->body)) << r->body;
    ASSERT_TRUE(e.contains("error")) << r->body;
    for (const char* f : {"message", "type", "param", "code"}) EXPECT_TRUE(e["error"].contains(f)) << f << r->body;
    EXPECT_EQ(e["error"]["type"], "invalid_request_error");
    if (k.param.empty()) EXPECT_TRUE(e["error"]["param"].is_null()) << r->body;
    else EXPECT_EQ(e["error"]["param"], k.param) << k.body << " -> " << r->body;
    EXPECT_FALSE(e["error"]["message"].get<std::string>().empty());
  }
  // Still serving after all that.
  auto ok = post(c, "/v1/completions", {{"prompt", "hi"}, {"max_tokens", 2}});
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200);
  auto h = c.Get("/health");
  EXPECT_EQ(h->status, 200);
}

TEST(ServeOps, ApiKeyOnV1Routes) {
  ServerProcess s({"--model", kModel}, {"TESSERA_API_KEY=sekrit"});
  auto c = s.client();
  auto r = c.Get("/v1/models");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 401);
  EXPECT_EQ(json::parse(r->body)["error"]["code"], "invalid_api_key");
  r = c.Get("/v1/models", {{"Authorization", "Bearer wrong"}});
  EXPECT_EQ(r->status, 401);
  r = post(c, "/v1/completions", {{"prompt", "hi"}}, {{"Authorization", "Bearer wrong"}});
  EXPECT_EQ(r->status, 401);
  EXPECT_TRUE(json::parse(r->body)["error"].contains("message"));
  r = c.Get("/v1/models", {{"Authorization", "Bearer sekrit"}});
  EXPECT_EQ(r->status, 200);
  r = post(c, "/v1/completions", {{"prompt", "hi"}, {"max_tokens", 2}}, {{"Authorization", "Bearer sekrit"}});
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(c.Get("/health")->status, 200);  // open: for load balancers
}

TEST(ServeOps, FloodGets429WithRetryAfterAndNoServerErrors) {
  ServerProcess s({"--model", kModel, "--max-queue", "2", "--max-num-seqs", "2"}, {kSlow});
  constexpr int kClients = 24;
  std::atomic<int> ok{0}, busy{0}, other{0};
  std::atomic<bool> retry_after{true};
  std::vector<std::thread> threads;
  for (int i = 0; i < kClients; ++i)
    threads.emplace_back([&] {
      auto c = s.client();
      auto r = post(c, "/v1/completions", {{"prompt", "flood"}, {"max_tokens", 64}, {"ignore_eos", true}});
      if (!r) {
        ++other;
      } else if (r->status == 200) {
        ++ok;
      } else if (r->status == 429) {
        ++busy;
        if (r->get_header_value("Retry-After").empty()) retry_after = false;
        if (json::parse(r->body)["error"]["code"] != "queue_full") ++other;
      } else {
        ++other;
      }
    });
  for (auto& t : threads) t.join();
  EXPECT_GT(busy.load(), 0);
  EXPECT_GE(ok.load(), 2);
  EXPECT_EQ(other.load(), 0);
  EXPECT_TRUE(retry_after.load());
  EXPECT_EQ(ok + busy, kClients);
}

// Polls /stats until nothing runs and no KV block is held.
bool pool_whole(const ServerProcess& s, double timeout_s) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  while (std::chrono::steady_clock::now() < deadline) {
    const json st = s.stats();
    if (!st.is_null() && st["kv_blocks_used"] == 0 && st["running"] == 0 && st["waiting"] == 0 &&
        st["in_flight"] == 0)
      return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

TEST(ServeOps, ClientDisconnectCancelsAndFreesBlocks) {
  ServerProcess s({"--model", kModel, "--block-size", "8"}, {kSlow});
  auto c = s.client();
  int chunks = 0;
  bool saw_blocks = false;
  const json body = {{"prompt", "The quick brown fox jumps over the lazy dog"},
                     {"max_tokens", 480},
                     {"ignore_eos", true},
                     {"stream", true}};
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.body = body.dump();
  req.set_header("Content-Type", "application/json");
  req.content_receiver = [&](const char*, size_t, uint64_t, uint64_t) {
    if (++chunks == 5) saw_blocks = s.stats()["kv_blocks_used"].get<int64_t>() > 0;
    return chunks < 5;  // then hang up mid-stream
  };
  const auto t0 = std::chrono::steady_clock::now();
  auto r = c.send(req);
  EXPECT_TRUE(saw_blocks);
  EXPECT_TRUE(pool_whole(s, 5.0));
  const double freed_after = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(freed_after, 5.0);
  auto m = c.Get("/metrics");
  EXPECT_NE(m->body.find("finished_reason=\"abort\""), std::string::npos);
  // The request did not run to its 480 tokens.
  EXPECT_LT(s.stats()["generation_tokens_total"].get<int64_t>(), 480);
}

TEST(ServeOps, RequestTimeoutAndBodyLimit) {
  ServerProcess s({"--model", kModel, "--request-timeout", "0.3", "--max-body-bytes", "4096"}, {kSlow});
  auto c = s.client();
  auto r = post(c, "/v1/completions", {{"prompt", "slow"}, {"max_tokens", 500}, {"ignore_eos", true}});
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 408) << r->body;
  EXPECT_EQ(json::parse(r->body)["error"]["code"], "request_timeout");
  std::string big(8000, 'a');
  r = post(c, "/v1/completions", {{"prompt", big}});
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 413);
  EXPECT_TRUE(json::parse(r->body)["error"].contains("message"));
  EXPECT_TRUE(pool_whole(s, 5.0));
}

TEST(ServeOps, SigtermDrainsInFlightThenExitsZero) {
  ServerProcess s({"--model", kModel, "--grace-period", "20"}, {kSlow});
  std::string body;
  int status = 0;
  std::thread t([&] {
    auto c = s.client();
    auto r = post(c, "/v1/completions",
                  {{"prompt", "drain"}, {"max_tokens", 100}, {"ignore_eos", true}, {"stream", true}});
    if (r) {
      status = r->status;
      body = r->body;
    }
  });
  // Wait until it runs, then ask the server to stop.
  for (int i = 0; i < 500 && s.stats()["running"] != 1; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  s.signal(SIGTERM);
  t.join();
  EXPECT_EQ(status, 200);
  const auto events = sse_data(body);
  ASSERT_GE(events.size(), 2u);
  EXPECT_EQ(events.back(), "[DONE]");
  EXPECT_EQ(json::parse(events[events.size() - 2])["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(s.wait(30), 0) << s.stderr_text();
  // No longer listening.
  httplib::Client c("127.0.0.1", s.port());
  EXPECT_FALSE(c.Get("/health"));
}

TEST(ServeOps, SigtermCancelsAfterGracePeriod) {
  ServerProcess s({"--model", kModel, "--grace-period", "0.3"}, {kSlow});
  std::string body;
  std::thread t([&] {
    auto c = s.client();
    auto r = post(c, "/v1/completions",
                  {{"prompt", "drain"}, {"max_tokens", 500}, {"ignore_eos", true}, {"stream", true}});
    if (r) body = r->body;
  });
  for (int i = 0; i < 500 && s.stats()["running"] != 1; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  const auto t0 = std::chrono::steady_clock::now();
  s.signal(SIGTERM);
  EXPECT_EQ(s.wait(30), 0) << s.stderr_text();
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 10.0);
  t.join();
  const auto events = sse_data(body);
  ASSERT_GE(events.size(), 2u);
  EXPECT_EQ(events.back(), "[DONE]");
  EXPECT_NE(events[events.size() - 2].find("shutting_down"), std::string::npos) << body.substr(body.size() - 300);
}

TEST(ServeOps, HealthFailsWhileTheEngineLoopStalls) {
  // Each engine step takes 1.5 s here; /health must notice the loop is stuck, not just
  // answer from the HTTP thread.
  ServerProcess s({"--model", kModel, "--health-timeout", "0.4"}, {"TESSERA_SERVE_STEP_DELAY_MS=1500"});
  auto c = s.client();
  EXPECT_EQ(c.Get("/health")->status, 200);
  std::thread t([&] {
    auto c2 = s.client();
    post(c2, "/v1/completions", {{"prompt", "stall"}, {"max_tokens", 1}});
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(900));
  auto r = c.Get("/health");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 503);
  EXPECT_EQ(json::parse(r->body)["error"]["code"], "engine_stalled");
  t.join();
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_EQ(c.Get("/health")->status, 200);
}

TEST(ServeOps, BadFlagsAreOneLineErrors) {
  for (const std::string& args : std::vector<std::string>{"--model /nonexistent", "--model " + kModel + " --port 70000",
                                 "--model " + kModel + " --max-queue -1", "", "--shape nope"}) {
    const auto r = testing::run_command(std::string(TESSERA_CLI_PATH) + " serve " + args);
    EXPECT_NE(r.code, 0) << args;
    EXPECT_FALSE(r.out.empty()) << args;
  }
}

// A second server on a port another one listens on must not start (no SO_REUSEPORT: the
// two would split the connections between their models): one line naming the port, exit 1.
TEST(ServeOps, BusyPortIsRefusedNamingIt) {
  testing::ServerProcess first({"--model", kModel});
  const std::string port = std::to_string(first.port());
  const auto r = testing::run_command(std::string(TESSERA_CLI_PATH) + " serve --model " + kModel + " --port " + port);
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("tessera: error: cannot listen on 127.0.0.1:" + port), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("listening"), std::string::npos) << r.out;
  // The first server still answers.
  httplib::Client c("127.0.0.1", first.port());
  auto res = c.Get("/health");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
}

// A model without a chat template: start-up says ChatML stands in, and so does /v1/models;
// the start-up summary names the model, its size, the KV pool and the concurrency.
TEST(ServeOps, StartUpSummaryAndTheChatMLFallback) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("tessera_no_template_" + std::to_string(getpid()));
  fs::create_directories(dir);
  for (const auto& e : fs::directory_iterator(kModel)) fs::copy_file(e.path(), dir / e.path().filename());
  {
    json cfg = json::parse(std::ifstream(dir / "tokenizer_config.json"));
    cfg.erase("chat_template");
    std::ofstream(dir / "tokenizer_config.json") << cfg.dump();
  }
  testing::ServerProcess s({"--model", dir.string(), "--max-num-seqs", "7"});
  const std::string err = s.stderr_text();
  EXPECT_NE(err.find("tessera serve: model " + dir.filename().string() + " (llama, "), std::string::npos) << err;
  EXPECT_NE(err.find("chat template: the model has none; ChatML stands in"), std::string::npos) << err;
  EXPECT_NE(err.find("at most 7 requests running, 256 queued"), std::string::npos) << err;
  httplib::Client c("127.0.0.1", s.port());
  auto r = c.Get("/v1/models");
  ASSERT_TRUE(r);
  EXPECT_EQ(json::parse(r->body)["data"][0]["chat_template"], "chatml (fallback)");
  fs::remove_all(dir);
}

}  // namespace
}  // namespace tessera
