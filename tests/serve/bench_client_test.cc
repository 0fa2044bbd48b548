// The HTTP load generator against an in-process mock server (cpp-httplib) whose streams have
// known chunk counts and delays: counts, failures, timing, concurrency cap, arrivals, SSE.
#include <gtest/gtest.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <limits>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include <httplib.h>
#include <nlohmann/json.hpp>

#include "tessera/base/error.h"
#include "tessera/infer/bench_serve.h"
#include "serve/bench_options.h"
#include "tessera/serve/bench_client.h"

namespace tessera::serve {
namespace {

using nlohmann::json;

constexpr int64_t kVocab = 1000;

// Mimics tessera serve's /v1/models and streaming /v1/completions. Every stream sends
// max_tokens tokens in chunks of `group` token ids, sleeping first_delay_ms before the first
// chunk and gap_ms before each later one, then a usage chunk and data: [DONE].
class MockServer {
 public:
  int first_delay_ms = 20, gap_ms = 5;
  int group = 1;
  bool send_usage = true, send_done = true;
  int fail_every = 0;  // every fail_every-th completion (1-based) gets 429 / 500 alternately
  std::string api_key;

  MockServer() {
    svr_.new_task_queue = [] { return new httplib::ThreadPool(64); };
    svr_.Get("/v1/models", [this](const httplib::Request& req, httplib::Response& res) {
      if (!authorized(req, res)) return;
      json j{{"object", "list"},
             {"data", json::array({json{{"id", "mock-model"}, {"vocab_size", kVocab}, {"max_model_len", 4096}}})}};
      res.set_content(j.dump(), "application/json");
    });
    svr_.Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) {
      if (!authorized(req, res)) return;
      const json body = json::parse(req.body);
      const int call = ++calls_;
      {
        std::lock_guard<std::mutex> lock(mu_);
        bodies_.push_back(body);
      }
      if (fail_every > 0 && call % fail_every == 0) {
        res.status = (call / fail_every) % 2 ? 429 : 500;
        res.set_content(R"({"error": {"message": "mock busy", "type": "x", "param": null, "code": null}})",
                        "application/json");
        return;
      }
      const int max_tokens = body.at("max_tokens").get<int>();
      const int active = ++active_;
      int seen = max_active_.load();
      while (active > seen && !max_active_.compare_exchange_weak(seen, active)) {
      }
      auto sent = std::make_shared<int>(0);
      // The stream stops counting as active before its last bytes go out: the client may
      // start its next request on reading [DONE], before httplib calls the releaser.
      auto counted = std::make_shared<std::atomic<bool>>(true);
      auto release = [this, counted] {
        if (counted->exchange(false)) --active_;
      };
      res.set_chunked_content_provider(
          "text/event-stream",
          [this, sent, max_tokens, release](size_t, httplib::DataSink& sink) {
            if (*sent < max_tokens) {
              if (!sleep_ms(*sent == 0 ? first_delay_ms : gap_ms)) return false;
              json ids = json::array();
              for (int k = 0; k < group && *sent < max_tokens; ++k, ++*sent) ids.push_back(7);
              json chunk{{"object", "text_completion"},
                         {"choices", json::array({json{{"index", 0},
                                                       {"text", "x"},
                                                       {"token_ids", ids},
                                                       {"finish_reason", *sent == max_tokens ? json("length")
                                                                                             : json(nullptr)}}})}};
              const std::string ev = "data: " + chunk.dump() + "\n\n";
              return sink.write(ev.data(), ev.size());
            }
            std::string tail;
            if (send_usage)
              tail += "data: " +
                      json{{"choices", json::array()},
                           {"usage", {{"prompt_tokens", 1}, {"completion_tokens", max_tokens}, {"total_tokens", 1}}}}
                          .dump() +
                      "\n\n";
            if (send_done) tail += "data: [DONE]\n\n";
            release();
            if (!tail.empty()) sink.write(tail.data(), tail.size());
            sink.done();
            return true;
          },
          [release](bool) { release(); });
    });
    // cpp-httplib 0.11 listens with a backlog of 5: a burst of connects overflows it and the
    // kernel drops SYNs (a 1 s retransmit). Listening again on the bound socket raises it.
    svr_.set_socket_options([this](socket_t sock) {
      httplib::default_socket_options(sock);
      listen_fd_ = sock;
    });
    port_ = svr_.bind_to_any_port("127.0.0.1");
    if (port_ > 0) ::listen(listen_fd_, 1024);
    // Bound and listening already: connections wait in the backlog until the loop accepts.
    thread_ = std::thread([this] { svr_.listen_after_bind(); });
  }
  ~MockServer() {
    stopping_ = true;
    svr_.stop();
    thread_.join();
  }

  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }
  int max_active() const { return max_active_.load(); }
  int calls() const { return calls_.load(); }
  std::vector<json> bodies() {
    std::lock_guard<std::mutex> lock(mu_);
    return bodies_;
  }

 private:
  bool authorized(const httplib::Request& req, httplib::Response& res) {
    if (api_key.empty() || req.get_header_value("Authorization") == "Bearer " + api_key) return true;
    res.status = 401;
    res.set_content(R"({"error": {"message": "bad key", "type": "auth", "param": null, "code": null}})",
                    "application/json");
    return false;
  }
  // Sleeps in small steps so a stopping server does not wait out long delays.
  bool sleep_ms(int ms) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
    while (std::chrono::steady_clock::now() < until) {
      if (stopping_) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(std::min(ms, 2)));
    }
    return true;
  }

  httplib::Server svr_;
  std::thread thread_;
  int port_ = 0;
  socket_t listen_fd_ = -1;
  std::atomic<bool> stopping_{false};
  std::atomic<int> calls_{0}, active_{0}, max_active_{0};
  std::mutex mu_;
  std::vector<json> bodies_;
};

HttpBenchOptions options(const MockServer& m, int64_t n, int64_t prompt, int64_t output) {
  return bench_options(m.url(), n, prompt, output);
}

TEST(SseParser, SplitsEventsAcrossArbitraryReads) {
  const std::string stream =
      ": a comment\r\n"
      "data: {\"a\": 1}\r\n\r\n"
      "event: message\n"
      "data: line one\n"
      "data:line two\n"
      "\n"
      "id: 5\n\n"  // an event without data: nothing
      "data: [DONE]\n\n"
      "data: incomplete";  // no blank line: never dispatched
  const std::vector<std::string> want{"{\"a\": 1}", "line one\nline two", "[DONE]"};
  std::mt19937 rng(3);
  for (int trial = 0; trial < 50; ++trial) {
    SseParser p;
    std::vector<std::string> got;
    size_t pos = 0;
    while (pos < stream.size()) {  // trial 0: one byte at a time; then random splits
      const size_t n = trial == 0 ? 1 : std::uniform_int_distribution<size_t>(1, 9)(rng);
      p.feed(std::string_view(stream).substr(pos, n), [&](const std::string& d) { got.push_back(d); });
      pos += n;
    }
    ASSERT_EQ(got, want) << "trial " << trial;
  }
}

TEST(PoissonArrivals, GapsAreExponentialWithMeanOneOverRate) {
  const double rate = 50;
  const auto t = poisson_arrival_times(4001, rate, 11);
  ASSERT_EQ(t.size(), 4001u);
  EXPECT_EQ(t[0], 0.0);
  double sum = 0;
  int above_mean = 0;
  for (size_t i = 1; i < t.size(); ++i) {
    const double g = t[i] - t[i - 1];
    ASSERT_GT(g, 0.0);
    sum += g;
    above_mean += g > 1 / rate;
  }
  // Mean 1/rate (sd of a 4000-gap mean: 1.6%); P(gap > mean) = e^-1 for an exponential.
  EXPECT_NEAR(sum / 4000, 1 / rate, 0.06 / rate);
  EXPECT_NEAR(above_mean / 4000.0, std::exp(-1.0), 0.03);
  EXPECT_EQ(poisson_arrival_times(4001, rate, 11), t);
  EXPECT_NE(poisson_arrival_times(4001, rate, 12), t);
  for (double x : poisson_arrival_times(7, std::numeric_limits<double>::infinity(), 1)) EXPECT_EQ(x, 0.0);
}

TEST(HttpBench, CountsTimesAndCapsConcurrency) {
  MockServer m;
  HttpBenchOptions o = options(m, 12, 16, 8);
  o.max_concurrency = 4;
  o.seed = 5;
  const HttpBenchResult r = run_http_bench(o);
  EXPECT_EQ(r.model, "mock-model");
  EXPECT_EQ(r.vocab_size, kVocab);
  EXPECT_EQ(r.completed, 12);
  EXPECT_EQ(r.failed, 0);
  EXPECT_EQ(r.output_tokens, 12 * 8);
  EXPECT_EQ(r.prompt_tokens, 12 * 16);
  EXPECT_EQ(r.short_outputs, 0);
  EXPECT_LE(m.max_active(), 4);
  EXPECT_GE(m.max_active(), 2);
  EXPECT_LE(r.max_in_flight, 4);
  for (const auto& q : r.requests) {
    EXPECT_GE(q.ttft_s, 0.020);  // the injected first delay
    EXPECT_EQ(q.itl_s.size(), 7u);
    EXPECT_GE(q.e2e_s, 0.020 + 7 * 0.005);
  }
  // The server spaces tokens 5 ms apart, but the client sees them later: a first token
  // delivered late shortens the gaps after it (seen: TPOT mean 3.95 ms on a loaded box).
  // The lower bounds only check that the gaps were measured, not the scheduler.
  EXPECT_GT(r.itl.p50, 0.0025);
  EXPECT_LT(r.itl.p50, 0.030);
  EXPECT_GT(r.tpot.mean, 0.0025);
  EXPECT_LT(r.tpot.mean, 0.030);
  EXPECT_GT(r.seconds, 3 * (0.020 + 7 * 0.005) * 0.9);  // 12 requests in waves of 4
  EXPECT_NEAR(r.output_tokens_per_s, 96 / r.seconds, 1e-9);
  EXPECT_NEAR(r.total_tokens_per_s, (96 + 192) / r.seconds, 1e-9);

  // The warm-up request, then the offline bench's requests for the same seed, in the schema.
  const auto bodies = m.bodies();
  ASSERT_EQ(bodies.size(), 13u);
  infer::ServeBenchOptions gen;
  gen.num_requests = 12;
  gen.prompt_len = {16, 16};
  gen.output_len = {8, 8};
  gen.seed = 5;
  infer::BenchRequest warmup;
  const auto reqs = infer::make_bench_requests(gen, kVocab, 4096, &warmup);
  std::vector<std::vector<int32_t>> want, got;
  for (const auto& q : reqs) want.push_back(q.prompt);
  for (const json& b : bodies) {
    EXPECT_EQ(b.at("model"), "mock-model");
    EXPECT_EQ(b.at("stream"), true);
    EXPECT_EQ(b.at("stream_options").at("include_usage"), true);
    EXPECT_EQ(b.at("ignore_eos"), true);
    EXPECT_EQ(b.at("temperature"), 0);
    const auto prompt = b.at("prompt").get<std::vector<int32_t>>();
    for (int32_t id : prompt) EXPECT_TRUE(id >= 0 && id < kVocab) << id;
    if (b.at("max_tokens") == 1) {
      EXPECT_EQ(prompt, warmup.prompt);
      continue;
    }
    EXPECT_EQ(b.at("max_tokens"), 8);
    got.push_back(prompt);
  }
  std::sort(want.begin(), want.end());
  std::sort(got.begin(), got.end());
  EXPECT_EQ(got, want);
  EXPECT_NE(format_http_bench(r).find("TTFT includes server queueing"), std::string::npos);
  const json j = json::parse(http_bench_json(r));
  EXPECT_EQ(j.at("completed"), 12);
  EXPECT_EQ(j.at("output_tokens"), 96);
}

TEST(HttpBench, UnlimitedConcurrencySendsAllAtOnce) {
  MockServer m;
  m.first_delay_ms = 60;
  HttpBenchOptions o = options(m, 10, 4, 2);
  const HttpBenchResult r = run_http_bench(o);
  EXPECT_EQ(r.completed, 10);
  EXPECT_EQ(r.workers, 10);
  EXPECT_GE(m.max_active(), 6);  // all 10 start together; a loaded machine may stagger a few
  EXPECT_LT(r.ttft.p99, 0.5);  // no connect stalls (a dropped SYN costs 1 s)
}

TEST(HttpBench, CountsFailuresWithStatusAndBody) {
  MockServer m;
  m.fail_every = 3;
  HttpBenchOptions o = options(m, 12, 8, 4);
  o.max_concurrency = 3;
  o.warmup = false;  // calls 3, 6, 9, 12 fail
  const HttpBenchResult r = run_http_bench(o);
  EXPECT_EQ(r.completed, 8);
  EXPECT_EQ(r.failed, 4);
  EXPECT_EQ(r.output_tokens, 8 * 4);
  ASSERT_EQ(r.failures.size(), 4u);
  int n429 = 0, n500 = 0;
  for (const auto& f : r.failures) {
    n429 += f.find("HTTP 429") != std::string::npos;
    n500 += f.find("HTTP 500") != std::string::npos;
    EXPECT_NE(f.find("mock busy"), std::string::npos) << f;
  }
  EXPECT_EQ(n429, 2);
  EXPECT_EQ(n500, 2);
}

TEST(HttpBench, CountsTokenIdsWithoutUsageAndFlagsMissingDone) {
  MockServer m;
  m.send_usage = false;
  m.group = 3;  // 10 tokens: chunks of 3, 3, 3, 1
  m.first_delay_ms = m.gap_ms = 1;
  HttpBenchOptions o = options(m, 4, 8, 10);
  HttpBenchResult r = run_http_bench(o);
  EXPECT_EQ(r.completed, 4);
  EXPECT_EQ(r.output_tokens, 40);
  EXPECT_EQ(r.requests[0].itl_s.size(), 3u);

  m.send_done = false;
  o.warmup = false;
  r = run_http_bench(o);
  EXPECT_EQ(r.failed, 4);
  ASSERT_FALSE(r.failures.empty());
  EXPECT_NE(r.failures[0].find("[DONE]"), std::string::npos) << r.failures[0];
}

TEST(HttpBench, PoissonArrivalsPaceTheSends) {
  MockServer m;
  m.first_delay_ms = m.gap_ms = 1;
  HttpBenchOptions o = options(m, 40, 4, 1);
  o.request_rate = 200;
  const HttpBenchResult r = run_http_bench(o);
  EXPECT_EQ(r.completed, 40);
  double last = 0;
  for (const auto& q : r.requests) {
    EXPECT_GE(q.send_s, q.arrival_s - 1e-3);
    EXPECT_LT(q.send_s, q.arrival_s + 0.1);
    last = std::max(last, q.arrival_s);
  }
  EXPECT_NEAR(last / 39, 1 / o.request_rate, 0.4 / o.request_rate);  // 39 gaps of mean 5 ms
  EXPECT_GE(r.seconds, last);
}

TEST(HttpBench, TimeoutAndAuthAndBadTargets) {
  MockServer m;
  m.api_key = "sekret";
  HttpBenchOptions o = options(m, 2, 4, 100);
  o.warmup = false;
  try {
    run_http_bench(o);
    ADD_FAILURE() << "no key: expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("HTTP 401"), std::string::npos) << e.what();
  }
  o.api_key = "sekret";
  m.first_delay_ms = 0;
  m.gap_ms = 50;  // 100 tokens take 5 s; the per-request timeout ends them
  o.timeout_s = 0.3;
  const auto t0 = std::chrono::steady_clock::now();
  const HttpBenchResult r = run_http_bench(o);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 2.0);
  EXPECT_EQ(r.failed, 2);
  ASSERT_FALSE(r.failures.empty());
  EXPECT_NE(r.failures[0].find("timed out"), std::string::npos) << r.failures[0];

  HttpBenchOptions bad = options(m, 2, 4, 4);
  bad.url = "http://127.0.0.1:1";  // nothing listens there
  EXPECT_THROW(run_http_bench(bad), Error);
  bad.url = "ftp://x";
  EXPECT_THROW(run_http_bench(bad), Error);
  bad = options(m, 2, 4, 4);
  bad.api_key = "sekret";
  bad.model = "other";
  EXPECT_THROW(run_http_bench(bad), Error);
  bad.model = "";
  bad.request_rate = 0;
  EXPECT_THROW(run_http_bench(bad), Error);
  bad.request_rate = 1;
  bad.dataset = "random";
  bad.shared_prefix = 8;
  EXPECT_THROW(run_http_bench(bad), Error);
}

TEST(HttpBench, SharedPrefixDataset) {
  MockServer m;
  m.first_delay_ms = m.gap_ms = 1;
  HttpBenchOptions o = options(m, 6, 5, 2);
  o.shared_prefix = 8;
  const HttpBenchResult r = run_http_bench(o);
  EXPECT_EQ(r.options.dataset, "shared-prefix");
  EXPECT_EQ(r.completed, 6);
  EXPECT_EQ(r.prompt_tokens, 6 * 13);
  const auto bodies = m.bodies();
  ASSERT_EQ(bodies.size(), 7u);  // with the warm-up, which computes the prefix first
  const auto first = bodies[0].at("prompt").get<std::vector<int32_t>>();
  std::set<std::vector<int32_t>> tails;
  for (const json& b : bodies) {
    const auto p = b.at("prompt").get<std::vector<int32_t>>();
    ASSERT_GE(p.size(), 8u);
    EXPECT_TRUE(std::equal(p.begin(), p.begin() + 8, first.begin()));
    if (b.at("max_tokens") != 1) {
      EXPECT_EQ(p.size(), 13u);
      tails.insert(std::vector<int32_t>(p.begin() + 8, p.end()));
    }
  }
  EXPECT_EQ(tails.size(), 6u);  // the rest is unique per prompt
}

}  // namespace
}  // namespace tessera::serve
