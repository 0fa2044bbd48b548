// Soak: 5,000 requests with random parameters (some invalid) and random client disconnects
// against one `tessera serve`: no 5xx, no crash, RSS back within 10% of its post-warm-up
// level, and the KV pool whole at the end.
#include <gtest/gtest.h>

#include <atomic>
#include <random>

#include "serve/server_process.h"

namespace tessera {
namespace {

using nlohmann::json;
using testing::ServerProcess;

const std::string kModel = TESSERA_SERVE_MODEL;

json random_request(std::mt19937_64& rng, bool& chat, bool& stream) {
  auto uni = [&](double a, double b) { return std::uniform_real_distribution<double>(a, b)(rng); };
  auto pick = [&](int n) { return static_cast<int>(rng() % static_cast<uint64_t>(n)); };
  static const char* kWords[] = {"hello", "world", "server", "token", "stream", "caf\xc3\xa9", "\xe6\x97\xa5",
                                 "fox", "12345", " ", "\n", "<|im_start|>", "journey"};
  std::string text;
  const int words = 1 + pick(40);
  for (int i = 0; i < words; ++i) text += std::string(kWords[pick(13)]) + " ";
  chat = pick(2) == 0;
  stream = pick(2) == 0;
  json r;
  if (chat) {
    r["messages"] = json::array();
    if (pick(2)) r["messages"].push_back({{"role", "system"}, {"content", "be brief"}});
    r["messages"].push_back({{"role", "user"}, {"content", text}});
  } else {
    r["prompt"] = pick(4) == 0 ? json(json::array({text, "second prompt"})) : json(text);
  }
  r["max_tokens"] = 1 + pick(32);
  const bool greedy = pick(3) == 0;
  r["temperature"] = greedy ? 0.0 : uni(0.1, 1.5);
  if (!greedy && pick(2)) r["n"] = 1 + pick(3);
  if (pick(2)) r["top_p"] = uni(0.1, 1.0);
  if (pick(3) == 0) r["top_k"] = pick(50);
  if (pick(4) == 0) r["min_p"] = uni(0.0, 0.2);
  if (pick(4) == 0) r["presence_penalty"] = uni(-2, 2);
  if (pick(4) == 0) r["frequency_penalty"] = uni(-2, 2);
  if (pick(4) == 0) r["repetition_penalty"] = uni(0.8, 1.3);
  if (pick(3) == 0) r["seed"] = rng() % 1000;
  if (pick(4) == 0) r["stop"] = json::array({"e", "th"});
  if (pick(4) == 0) r["ignore_eos"] = true;
  if (pick(5) == 0) {
    if (chat) {
      r["logprobs"] = true;
      r["top_logprobs"] = pick(5);
    } else {
      r["logprobs"] = pick(5);
    }
  }
  if (stream) {
    r["stream"] = true;
    if (pick(2)) r["stream_options"] = {{"include_usage", true}};
  }
  // About one in ten is invalid in some way: the server must answer 4xx and carry on.
  switch (pick(40)) {
    case 0: r["temperature"] = -1; break;
    case 1: r["max_tokens"] = 100000; break;
    case 2: r["top_p"] = "x"; break;
    case 3: r["model"] = "other"; break;
    default: break;
  }
  return r;
}

TEST(ServeSoak, FiveThousandRandomRequestsWithDisconnects) {
  // A small pool (paged in during warm-up) so RSS measures leaks, not first touches of a
  // big pool; it also forces preemptions.
  ServerProcess s({"--model", kModel, "--kv-cache-memory", "4000000", "--block-size", "8", "--max-num-seqs", "32",
                   "--max-queue", "64"});
  constexpr int kRequests = 5000, kThreads = 12, kWarmup = 500;
  std::atomic<int> next{0}, done{0}, ok{0}, client4xx{0}, server5xx{0}, transport{0}, disconnects{0};
  std::atomic<int64_t> rss_warm{-1};
  auto worker = [&](int t) {
    std::mt19937_64 rng(1000 + t);
    auto c = s.client(60);
    while (true) {
      const int i = next.fetch_add(1);
      if (i >= kRequests) break;
      if (i == kWarmup) rss_warm = s.rss_kib();
      bool chat = false, stream = false;
      const json body = random_request(rng, chat, stream);
      const std::string path = chat ? "/v1/chat/completions" : "/v1/completions";
      const bool hang_up = rng() % 6 == 0;  // disconnect mid-stream (or mid-wait)
      auto send = [&]() -> httplib::Result {
        if (stream && hang_up) {
          httplib::Request req;
          req.method = "POST";
          req.path = path;
          req.body = body.dump();
          req.set_header("Content-Type", "application/json");
          const int after = 1 + static_cast<int>(rng() % 4);
          auto chunks = std::make_shared<int>(0);
          req.content_receiver = [chunks, after](const char*, size_t, uint64_t, uint64_t) {
            return ++*chunks < after;
          };
          return c.send(req);
        }
        if (hang_up) {
          httplib::Client quick("127.0.0.1", s.port());
          quick.set_read_timeout(0, 2000);  // 2 ms: gives up before the answer
          return quick.Post(path, body.dump(), "application/json");
        }
        return c.Post(path, body.dump(), "application/json");
      };
      auto r = send();
      if (hang_up) ++disconnects;
      if (r) {
        if (r->status >= 500) ++server5xx;
        else if (r->status >= 400) ++client4xx;
        else ++ok;
      } else if (!hang_up) {
        ++transport;
      }
      ++done;
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(worker, t);
  for (auto& t : threads) t.join();
  ASSERT_EQ(done.load(), kRequests);
  // The server is alive, idle, and its pool whole.
  bool whole = false;
  for (int i = 0; i < 250 && !whole; ++i) {
    const json st = s.stats();
    whole = !st.is_null() && st["kv_blocks_used"] == 0 && st["running"] == 0 && st["waiting"] == 0 &&
            st["in_flight"] == 0;
    if (!whole) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_TRUE(whole) << s.stats().dump();
  auto c = s.client();
  auto h = c.Get("/health");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 200);
  auto m = c.Get("/metrics");
  ASSERT_TRUE(m);
  EXPECT_EQ(m->body.find("tessera_http_responses_total{code=\"5"), std::string::npos);
  EXPECT_EQ(server5xx.load(), 0);
  EXPECT_EQ(transport.load(), 0);
  EXPECT_GT(ok.load(), kRequests / 2);
  EXPECT_GT(client4xx.load(), 0);
  EXPECT_GT(disconnects.load(), kRequests / 10);
  // Idle for a moment: the server returns freed heap pages to the system when idle.
  std::this_thread::sleep_for(std::chrono::milliseconds(1600));
  const int64_t rss_end = s.rss_kib();
  ASSERT_GT(rss_warm.load(), 0);
  EXPECT_LE(rss_end, rss_warm.load() * 1.10) << "RSS after warm-up " << rss_warm.load() << " KiB, at the end "
                                              << rss_end << " KiB";
  std::printf("soak: %d ok, %d 4xx, %d disconnects; RSS %lld KiB after warm-up, %lld KiB at the end\n", ok.load(),
              client4xx.load(), disconnects.load(), static_cast<long long>(rss_warm.load()),
              static_cast<long long>(rss_end));
  // And it still shuts down cleanly.
  s.signal(SIGTERM);
  EXPECT_EQ(s.wait(30), 0) << s.stderr_text();
}

}  // namespace
}  // namespace tessera
