// Prefill/decode disaggregation end to end: `tessera router` in front of `tessera serve --role
// prefill` and `--role decode` processes on loopback, against one colocated `tessera serve`.
// Checks: token-identical output (greedy, and seeded sampling) over tcp and shm; KV bytes per
// request against the closed-form size of a block (config.json); a decode worker killed with
// SIGKILL mid-stream fails only its own requests (an error naming it) while the other decode
// worker's finish and new requests go there.
#include <gtest/gtest.h>

#include <signal.h>

#include <atomic>
#include <fstream>
#include <memory>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "serve/server_process.h"

namespace tessera::testing {
namespace {

using nlohmann::json;

const std::string kModel = TESSERA_SERVE_MODEL;

std::vector<std::string> worker_args(const std::vector<std::string>& extra) {
  std::vector<std::string> a = {"--model", kModel, "--kv-cache-memory", "8000000", "--block-size", "16",
                                "--batch-invariant", "--max-num-seqs", "16"};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

std::string url(const ServerProcess& p) { return "http://127.0.0.1:" + std::to_string(p.port()); }

// A router with its prefill and decode workers.
struct Cluster {
  std::vector<std::unique_ptr<ServerProcess>> prefill, decode;
  std::unique_ptr<ServerProcess> router;
  Cluster(int prefills, int decodes, const std::string& transport, const std::vector<std::string>& decode_env = {}) {
    for (int i = 0; i < prefills; ++i)
      prefill.push_back(std::make_unique<ServerProcess>(worker_args({"--role", "prefill"})));
    for (int i = 0; i < decodes; ++i)
      decode.push_back(std::make_unique<ServerProcess>(
          worker_args({"--role", "decode", "--kv-transport", transport}), decode_env));
    std::string p, d;
    for (auto& w : prefill) p += (p.empty() ? "" : ",") + url(*w);
    for (auto& w : decode) d += (d.empty() ? "" : ",") + url(*w);
    router = std::make_unique<ServerProcess>(
        std::vector<std::string>{"--prefill", p, "--decode", d, "--kv-transport", transport, "--health-interval", "0.2"},
        std::vector<std::string>{}, "router");
  }
};

struct Reply {
  int status = 0;
  std::vector<int32_t> tokens;  // streamed token_ids
  std::string text, finish, error;
  json usage, body;
  bool done = false;
};

// POSTs a completion or chat request; streams read chunk by chunk.
Reply post(const ServerProcess& s, const std::string& path, json body, double timeout_s = 120) {
  auto c = s.client(timeout_s);
  Reply r;
  const bool stream = body.value("stream", false);
  if (stream) body["stream_options"] = {{"include_usage", true}};
  auto res = c.Post(path, body.dump(), "application/json");
  if (!res) {
    r.error = "transport: " + httplib::to_string(res.error());
    return r;
  }
  r.status = res->status;
  if (!stream || res->status != 200) {
    r.body = json::parse(res->body, nullptr, false);
    if (res->status == 200) {
      const json& ch = r.body["choices"][0];
      r.text = ch.contains("text") ? ch["text"].get<std::string>() : ch["message"]["content"].get<std::string>();
      r.finish = ch["finish_reason"].is_null() ? "" : ch["finish_reason"].get<std::string>();
      r.usage = r.body["usage"];
    }
    return r;
  }
  for (const auto& d : sse_data(res->body)) {
    if (d == "[DONE]") {
      r.done = true;
      continue;
    }
    const json j = json::parse(d);
    if (j.contains("error")) {
      r.error = j["error"]["message"].get<std::string>();
      continue;
    }
    if (!j["usage"].is_null() && j.contains("usage")) r.usage = j["usage"];
    for (const auto& ch : j["choices"]) {
      if (ch.contains("token_ids")) for (int32_t t : ch["token_ids"]) r.tokens.push_back(t);
      if (ch.contains("text")) r.text += ch["text"].get<std::string>();
      if (ch.contains("delta") && ch["delta"].contains("content")) r.text += ch["delta"]["content"].get<std::string>();
      if (!ch["finish_reason"].is_null()) r.finish = ch["finish_reason"].get<std::string>();
    }
  }
  return r;
}

std::vector<int32_t> ids(int n, int seed) {
  std::vector<int32_t> v;
  for (int i = 0; i < n; ++i) v.push_back(3 + (i * 37 + seed * 101) % 300);
  return v;
}

// The requests both setups answer: token-id prompts with and without a partial last block
// (16-token blocks), text, chat; streamed and not; greedy and seeded sampling.
std::vector<std::pair<std::string, json>> requests() {
  std::vector<std::pair<std::string, json>> out;
  int k = 0;
  for (int n : {5, 16, 37, 64, 90}) {
    ++k;
    json b = {{"prompt", ids(n, k)}, {"max_tokens", 20}, {"temperature", 0}, {"ignore_eos", true}};
    b["stream"] = true;
    out.push_back({"/v1/completions", b});
    b["stream"] = false;
    out.push_back({"/v1/completions", b});
  }
  out.push_back({"/v1/completions", {{"prompt", "The quick brown fox jumps over the lazy dog. A journey of a thousand"},
                                     {"max_tokens", 24}, {"temperature", 0}, {"stream", true}}});
  out.push_back({"/v1/completions", {{"prompt", ids(50, 9)}, {"max_tokens", 24}, {"temperature", 0.9}, {"top_p", 0.9},
                                     {"seed", 1234}, {"ignore_eos", true}, {"stream", true}}});
  out.push_back({"/v1/completions", {{"prompt", "Hello world! How are you"}, {"max_tokens", 16}, {"temperature", 0},
                                     {"stop", {" the"}}, {"stream", true}}});
  out.push_back({"/v1/chat/completions",
                 {{"messages", {{{"role", "user"}, {"content", "Tell me about the weather, the sun and the server."}}}},
                  {"max_tokens", 24}, {"temperature", 0}, {"stream", true}}});
  out.push_back({"/v1/chat/completions",
                 {{"messages", {{{"role", "user"}, {"content", "Numbers like 12345 and 2026 appear in text"}}}},
                  {"max_tokens", 12}, {"temperature", 0}}});
  out.push_back({"/v1/completions", {{"prompt", ids(20, 3)}, {"max_tokens", 1}, {"temperature", 0}, {"stream", true}}});
  return out;
}

void expect_identical(const std::string& transport) {
  ServerProcess colocated(worker_args({}));
  Cluster cl(1, 1, transport);
  int i = 0;
  for (const auto& [path, body] : requests()) {
    SCOPED_TRACE("request " + std::to_string(i++) + ": " + body.dump());
    const Reply a = post(colocated, path, body), b = post(*cl.router, path, body);
    ASSERT_EQ(a.status, 200) << a.body.dump();
    ASSERT_EQ(b.status, 200) << b.body.dump() << cl.router->stderr_text();
    EXPECT_TRUE(b.error.empty()) << b.error;
    if (body.value("stream", false)) { EXPECT_FALSE(b.tokens.empty()); }  // (the text may be special tokens)
    EXPECT_EQ(a.tokens, b.tokens);
    EXPECT_EQ(a.text, b.text);
    EXPECT_EQ(a.finish, b.finish);
    EXPECT_EQ(a.done, b.done);
    ASSERT_TRUE(a.usage.is_object());
    ASSERT_TRUE(b.usage.is_object());
    EXPECT_EQ(a.usage["prompt_tokens"], b.usage["prompt_tokens"]);
    EXPECT_EQ(a.usage["completion_tokens"], b.usage["completion_tokens"]);
    if (body.value("stream", false) && body.value("ignore_eos", false)) {
      EXPECT_EQ(static_cast<int64_t>(b.tokens.size()), body["max_tokens"].get<int64_t>());
    }
  }
}

TEST(Disagg, OutputIsTokenIdenticalToColocatedOverTcp) { expect_identical("tcp"); }
TEST(Disagg, OutputIsTokenIdenticalToColocatedOverShm) { expect_identical("shm"); }

int64_t metric(const ServerProcess& s, const std::string& name) {
  auto r = s.client(10).Get("/metrics");
  if (!r) return -1;
  const std::regex re(name + "\\{[^}]*\\} ([0-9.e+]+)");
  std::smatch m;
  return std::regex_search(r->body, m, re) ? static_cast<int64_t>(std::stod(m[1])) : -1;
}

TEST(Disagg, KvBytesPerRequestFollowTheFormula) {
  // One block = 2 (K, V) x layers x kv_heads x block_size x head_dim x 2 bytes (bf16 cache).
  std::ifstream f(kModel + "/config.json");
  const json c = json::parse(f);
  const int64_t layers = c["num_hidden_layers"], heads = c["num_attention_heads"];
  const int64_t kv_heads = c.value("num_key_value_heads", heads);
  const int64_t head_dim = c.value("head_dim", c["hidden_size"].get<int64_t>() / heads);
  const int64_t block = 2 * layers * kv_heads * 16 * head_dim * 2;
  for (const std::string transport : {"tcp", "shm"}) {
    SCOPED_TRACE(transport);
    Cluster cl(1, 1, transport);
    int64_t before = metric(*cl.decode[0], "tessera_kv_transfer_bytes_total");
    ASSERT_EQ(before, 0);
    for (int n : {7, 16, 40, 100}) {
      const json body = {{"prompt", ids(n, n)}, {"max_tokens", 3}, {"temperature", 0}, {"ignore_eos", true}};
      const Reply r = post(*cl.router, "/v1/completions", body);
      ASSERT_EQ(r.status, 200) << r.body.dump();
      const int64_t after = metric(*cl.decode[0], "tessera_kv_transfer_bytes_total");
      EXPECT_EQ(after - before, (n / 16) * block) << "prompt of " << n << " tokens";
      EXPECT_EQ(metric(*cl.prefill[0], "tessera_kv_transfer_bytes_total"), after);  // sent = received
      before = after;
      // The same prompt again: the decode worker caches its blocks now, so nothing moves.
      const Reply again = post(*cl.router, "/v1/completions", body);
      ASSERT_EQ(again.status, 200);
      EXPECT_EQ(again.text, r.text);
      EXPECT_EQ(metric(*cl.decode[0], "tessera_kv_transfer_bytes_total"), before);
    }
    EXPECT_EQ(metric(*cl.decode[0], "tessera_kv_transfers_total"), 8);
  }
}

TEST(Disagg, KilledDecodeWorkerFailsOnlyItsOwnRequests) {
  // Slow decode steps keep the streams running while one worker is killed.
  Cluster cl(1, 2, "tcp", {"TESSERA_SERVE_STEP_DELAY_MS=40"});
  const std::string victim = url(*cl.decode[0]), survivor = url(*cl.decode[1]);
  constexpr int kRequests = 6;
  std::vector<Reply> replies(kRequests);
  std::vector<std::thread> threads;
  for (int i = 0; i < kRequests; ++i)
    threads.emplace_back([&, i] {
      replies[i] = post(*cl.router, "/v1/completions",
                        {{"prompt", ids(30 + i, i)}, {"max_tokens", 60}, {"temperature", 0}, {"ignore_eos", true},
                         {"stream", true}});
    });
  // Kill once both decode workers are streaming.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (std::chrono::steady_clock::now() < deadline &&
         (cl.decode[0]->stats().value("running", 0) == 0 || cl.decode[1]->stats().value("running", 0) == 0))
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  ASSERT_GT(cl.decode[0]->stats().value("running", 0), 0);
  cl.decode[0]->signal(SIGKILL);
  for (auto& t : threads) t.join();
  int failed = 0, completed = 0;
  for (const Reply& r : replies) {
    ASSERT_EQ(r.status, 200);
    EXPECT_TRUE(r.done);
    if (!r.error.empty()) {
      ++failed;
      EXPECT_NE(r.error.find(victim), std::string::npos) << r.error;
      EXPECT_EQ(r.error.find(survivor), std::string::npos) << r.error;
    } else {
      ++completed;
      EXPECT_EQ(r.tokens.size(), 60u);
      EXPECT_EQ(r.finish, "length");
    }
  }
  EXPECT_GT(failed, 0);
  EXPECT_GT(completed, 0);
  // New requests go to the live worker, streamed or not.
  for (int i = 0; i < 4; ++i) {
    const Reply r = post(*cl.router, "/v1/completions",
                         {{"prompt", ids(20, 50 + i)}, {"max_tokens", 5}, {"temperature", 0}, {"ignore_eos", true},
                          {"stream", i % 2 == 0}});
    EXPECT_EQ(r.status, 200) << r.body.dump();
    EXPECT_TRUE(r.error.empty()) << r.error;
  }
  auto w = json::parse(cl.router->client(10).Get("/workers")->body);
  for (const auto& x : w["workers"])
    if (x["url"] == victim) { EXPECT_FALSE(x["up"].get<bool>()); }
}

TEST(Disagg, StoppedWorkerIsMarkedDownAndComesBack) {
  Cluster cl(1, 2, "tcp");
  auto up = [&](const std::string& u) {
    auto w = json::parse(cl.router->client(10).Get("/workers")->body);
    for (const auto& x : w["workers"])
      if (x["url"] == u) return x["up"].get<bool>();
    return false;
  };
  const std::string d0 = url(*cl.decode[0]);
  ASSERT_TRUE(up(d0));
  cl.decode[0]->signal(SIGSTOP);
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (up(d0) && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_FALSE(up(d0));
  // Requests go to the other decode worker meanwhile.
  for (int i = 0; i < 3; ++i) {
    const Reply r = post(*cl.router, "/v1/completions", {{"prompt", ids(24, i)}, {"max_tokens", 4}, {"temperature", 0}});
    EXPECT_EQ(r.status, 200) << r.body.dump();
  }
  cl.decode[0]->signal(SIGCONT);
  deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (!up(d0) && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_TRUE(up(d0));
}

TEST(Disagg, RouterRefusesWhatItCannotServe) {
  Cluster cl(1, 1, "tcp");
  struct Case {
    json body;
    std::string param;
  };
  const std::vector<Case> cases = {{{{"prompt", "hi"}, {"n", 2}, {"temperature", 1}}, "n"},
                                   {{{"prompt", "hi"}, {"logprobs", 2}}, "logprobs"},
                                   {{{"prompt", {"a", "b"}}}, "prompt"},
                                   {{{"prompt", "hi"}, {"temperature", -1}}, "temperature"}};
  for (const auto& c : cases) {
    const Reply r = post(*cl.router, "/v1/completions", c.body);
    EXPECT_EQ(r.status, 400) << c.body.dump();
    EXPECT_EQ(r.body["error"]["param"], c.param) << r.body.dump();
  }
  // No live decode worker: 503 naming the missing role.
  cl.decode[0]->signal(SIGKILL);
  cl.decode[0]->wait(10);
  std::this_thread::sleep_for(std::chrono::milliseconds(800));
  const Reply r = post(*cl.router, "/v1/completions", {{"prompt", "hi"}, {"max_tokens", 2}});
  EXPECT_EQ(r.status, 503);
  EXPECT_NE(r.body.dump().find("decode"), std::string::npos) << r.body.dump();
}

}  // namespace
}  // namespace tessera::testing
