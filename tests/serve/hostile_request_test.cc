// Hostile request bodies against a real `tessera serve` on loopback: each gets a 4xx with
// the OpenAI error shape while 8 ordinary streams keep running to completion, and the
// process lives (no signal, no 5xx, KV pool whole afterwards).
#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "serve/hostile_bodies.h"
#include "serve/server_process.h"

namespace tessera {
namespace {

using nlohmann::json;
using testing::ServerProcess;

const std::string kModel = TESSERA_SERVE_MODEL;

void expect_openai_error(const httplib::Result& r, const std::string& name) {
  ASSERT_TRUE(r) << name << ": no response (" << httplib::to_string(r.error()) << ")";
  EXPECT_GE(r->status, 400) << name << " -> " << r->body.substr(0, 300);
  EXPECT_LT(r->status, 500) << name << " -> " << r->body.substr(0, 300);
  json e;
  ASSERT_NO_THROW(e = json::parse(r->body)) << name << ": " << r->body.substr(0, 300);
  ASSERT_TRUE(e.contains("error") && e["error"].is_object()) << name;
  for (const char* f : {"message", "type", "param", "code"}) EXPECT_TRUE(e["error"].contains(f)) << name << " " << f;
  EXPECT_FALSE(e["error"]["message"].get<std::string>().empty()) << name;
  // One line, short enough to read: never the body echoed back.
  const std::string m = e["error"]["message"];
  EXPECT_EQ(m.find('\n'), std::string::npos) << name << ": " << m.substr(0, 300);
  EXPECT_LT(m.size(), 1000u) << name;
}

TEST(ServeHostile, EveryHostileBodyIsA4xxWhileEightStreamsFinish) {
  ServerProcess s({"--model", kModel, "--block-size", "8", "--max-num-seqs", "16"});
  // Eight streams long enough to span every hostile request.
  std::atomic<int> finished{0}, broken{0};
  std::atomic<bool> hostile_done{false};
  std::vector<std::thread> streams;
  for (int i = 0; i < 8; ++i)
    streams.emplace_back([&, i] {
      auto c = s.client(120);
      int rounds = 0;
      // Each stream repeats until the hostile requests are all answered (at least once).
      while (rounds == 0 || !hostile_done.load()) {
        const json body = {{"prompt", "stream number " + std::to_string(i)}, {"max_tokens", 48},
                           {"ignore_eos", true}, {"temperature", 0}, {"stream", true}};
        auto r = c.Post("/v1/completions", body.dump(), "application/json");
        const auto events = r ? testing::sse_data(r->body) : std::vector<std::string>{};
        if (!r || r->status != 200 || events.empty() || events.back() != "[DONE]") {
          ++broken;
          return;
        }
        ++rounds;
      }
      ++finished;
    });
  auto c = s.client(60);
  for (const auto& h : testing::hostile_bodies()) {
    auto r = c.Post(h.path, h.body, "application/json");
    expect_openai_error(r, h.name);
  }
  hostile_done = true;
  for (auto& t : streams) t.join();
  EXPECT_EQ(broken.load(), 0);
  EXPECT_EQ(finished.load(), 8);
  auto health = c.Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
  auto m = c.Get("/metrics");
  ASSERT_TRUE(m);
  EXPECT_EQ(m->body.find("tessera_http_responses_total{code=\"5"), std::string::npos);
  s.signal(SIGTERM);
  EXPECT_EQ(s.wait(30), 0) << s.stderr_text();
}

}  // namespace
}  // namespace tessera
