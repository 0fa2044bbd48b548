// Internals of serve::Router shared by router.cc (routing and the request path) and
// router_server.cc (the HTTP server, health-check thread and metrics). Not a public interface.
#pragma once

#include <httplib.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>
#include <xxhash.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <optional>
#include <mutex>
#include <thread>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "tessera/base/error.h"
#include "tessera/serve/bench_client.h"
#include "tessera/serve/http_reply.h"
#include "tessera/serve/openai.h"
#include "tessera/serve/prom_histogram.h"
#include "tessera/serve/router.h"

namespace tessera::serve {
namespace router_detail {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

using serve::dump;
using serve::send_json;

struct Worker {
  std::string url, host;
  int port = 0;
  bool decode = false;
  std::atomic<bool> up{false};
  std::atomic<int64_t> outstanding{0};
  std::atomic<int> kv_port{0};
  std::atomic<int64_t> block_size{16};
  std::atomic<int64_t> requests{0}, failures{0};
  mutable std::mutex m;
  std::string last_error;  // under m
  const char* role() const { return decode ? "decode" : "prefill"; }
};

struct Counted {  // outstanding + 1 for a scope
  explicit Counted(Worker& w) : w(w) { ++w.outstanding; }
  ~Counted() { --w.outstanding; }
  Worker& w;
};

inline std::unique_ptr<httplib::Client> client_for(const Worker& w, double timeout_s) {
  auto c = std::make_unique<httplib::Client>(w.host, w.port);
  c->set_connection_timeout(2, 0);
  c->set_read_timeout(static_cast<time_t>(timeout_s), 0);
  c->set_write_timeout(30, 0);
  c->set_keep_alive(false);
  return c;
}

// A prefill worker's answer, read on its own thread: the first-token event, then the KV event.
struct PrefillCall {
  std::mutex m;
  std::condition_variable cv;
  int status = 0;
  std::string error_body, transport_error;
  std::deque<json> events;
  bool ended = false;
  std::atomic<bool> cancel{false};
  std::thread thread;

  void start(const Worker& w, std::string body, double timeout_s) {
    thread = std::thread([this, &w, body = std::move(body), timeout_s] {
      auto c = client_for(w, timeout_s);
      httplib::Request hr;
      hr.method = "POST";
      hr.path = "/kv/prefill";
      hr.body = body;
      hr.set_header("Content-Type", "application/json");
      SseParser sse;
      hr.response_handler = [this](const httplib::Response& r) {
        std::lock_guard<std::mutex> lock(m);
        status = r.status;
        return true;
      };
      hr.content_receiver = [this, &sse](const char* data, size_t n, uint64_t, uint64_t) {
        if (status != 200) {
          if (error_body.size() < 65536) error_body.append(data, n);
          return true;
        }
        sse.feed(std::string_view(data, n), [this](const std::string& d) {
          json j;
          try {
            j = json::parse(d);
          } catch (const std::exception&) {
            return;
          }
          {
            std::lock_guard<std::mutex> lock(m);
            events.push_back(std::move(j));
          }
          cv.notify_all();
        });
        return !cancel.load();
      };
      auto res = c->send(hr);
      {
        std::lock_guard<std::mutex> lock(m);
        if (!res) transport_error = httplib::to_string(res.error());
        ended = true;
      }
      cv.notify_all();
    });
  }
  // The next event; false when the call ended without one.
  bool next(json& out) {
    std::unique_lock<std::mutex> lock(m);
    cv.wait(lock, [&] { return !events.empty() || ended; });
    if (events.empty()) return false;
    out = std::move(events.front());
    events.pop_front();
    return true;
  }
  ~PrefillCall() {
    cancel = true;
    if (thread.joinable()) thread.join();
  }
};

}  // namespace router_detail

using namespace router_detail;  // (within tessera::serve, for the router's files)

struct Router::Impl {
  explicit Impl(RouterConfig c) : cfg(std::move(c)) {
    cfg.validate();
    for (const auto& u : cfg.prefill) add_worker(u, false);
    for (const auto& u : cfg.decode) add_worker(u, true);
  }
  void add_worker(const std::string& url, bool decode) {
    auto w = std::make_unique<Worker>();
    auto [h, p] = parse_worker_url(url, decode ? "--decode" : "--prefill");
    w->url = "http://" + h + ":" + std::to_string(p);
    w->host = h;
    w->port = p;
    w->decode = decode;
    (decode ? decodes : prefills).push_back(std::move(w));
  }

  RouterConfig cfg;
  std::vector<std::unique_ptr<Worker>> prefills, decodes;
  httplib::Server http;
  std::atomic<int> port{0};
  std::atomic<bool> stopping{false};
  std::mutex stop_m;
  std::condition_variable stop_cv;
  std::atomic<int64_t> next_id{1};
  const int64_t id_base = static_cast<int64_t>(::getpid()) << 32;
  std::mutex affinity_m, pick_m;
  std::unordered_map<uint64_t, Worker*> affinity;  // prefix key -> the prefill worker that saw it
  std::atomic<uint64_t> rr_prefill{0}, rr_decode{0};
  // metrics
  PromHistogram kv_seconds, ttft;
  std::atomic<int64_t> kv_bytes{0}, kv_blocks{0}, affinity_hits{0}, requests{0}, failed{0};

  // ---- health ----
  void mark_down(Worker& w, const std::string& why) {
    {
      std::lock_guard<std::mutex> lock(w.m);
      w.last_error = why;
    }
    if (w.up.exchange(false)) std::fprintf(stderr, "tessera router: %s worker %s is down: %s\n", w.role(), w.url.c_str(), why.c_str());
  }
  void check(Worker& w) {
    auto c = client_for(w, 2);
    auto r = c->Get("/health");
    if (!r || r->status != 200) {
      mark_down(w, r ? "/health answered " + std::to_string(r->status) : "/health: " + httplib::to_string(r.error()));
      return;
    }
    auto info = c->Get("/kv/info");
    json j;
    try {
      TESSERA_CHECK(info && info->status == 200, "no /kv/info");
      j = json::parse(info->body);
      const std::string role = j.at("role").get<std::string>();
      TESSERA_CHECK(role == w.role(), "it serves as ", role, ", not --role ", w.role());
      w.block_size = j.at("block_size").get<int64_t>();
      if (w.decode) {
        w.kv_port = j.at("kv_port").get<int>();
        bool has = false;
        for (const auto& t : j.at("transports")) has = has || t == cfg.kv_transport;
        TESSERA_CHECK(has, "it does not take --kv-transport ", cfg.kv_transport, " (start it with --kv-transport ",
                      cfg.kv_transport, ")");
      }
    } catch (const std::exception& e) {
      mark_down(w, std::string("/kv/info: ") + e.what());
      return;
    }
    if (!w.up.exchange(true)) std::fprintf(stderr, "tessera router: %s worker %s is up\n", w.role(), w.url.c_str());
  }
  void check_all() {
    for (auto* list : {&prefills, &decodes})
      for (auto& w : *list) check(*w);
  }
  void health_loop() {
    std::unique_lock<std::mutex> lock(stop_m);
    while (!stopping) {
      stop_cv.wait_for(lock, std::chrono::duration<double>(cfg.health_interval_s));
      if (stopping) break;
      lock.unlock();
      check_all();
      lock.lock();
    }
  }

  // ---- routing ----
  static uint64_t affinity_key(const json& body, int64_t tokens) {
    if (auto it = body.find("prompt"); it != body.end()) {
      if (it->is_array()) {
        std::vector<int64_t> ids;
        for (const auto& t : *it) {
          if (static_cast<int64_t>(ids.size()) >= tokens) break;
          ids.push_back(t.is_number_integer() ? t.get<int64_t>() : -1);
        }
        return XXH3_64bits(ids.data(), ids.size() * sizeof(int64_t));
      }
      if (it->is_string()) {  // ~4 bytes a token
        const std::string& s = it->get_ref<const std::string&>();
        return XXH3_64bits(s.data(), std::min<size_t>(s.size(), static_cast<size_t>(4 * tokens)));
      }
    }
    const std::string m = body.contains("messages") ? body["messages"].dump() : std::string();
    return XXH3_64bits(m.data(), std::min<size_t>(m.size(), static_cast<size_t>(4 * tokens)));
  }
  Worker* least_loaded(std::vector<std::unique_ptr<Worker>>& list, const std::vector<Worker*>& tried) {
    Worker* best = nullptr;
    const size_t n = list.size(), start = (&list == &prefills ? rr_prefill : rr_decode)++ % n;  // ties go round
    for (size_t k = 0; k < n; ++k) {
      Worker* w = list[(start + k) % n].get();
      if (!w->up || std::find(tried.begin(), tried.end(), w) != tried.end()) continue;
      if (!best || w->outstanding < best->outstanding) best = w;
    }
    return best;
  }
  Worker* pick_prefill(uint64_t key, const std::vector<Worker*>& tried) {
    Worker* least = least_loaded(prefills, tried);
    if (!least) return nullptr;
    std::lock_guard<std::mutex> lock(affinity_m);
    auto it = affinity.find(key);
    if (it != affinity.end()) {
      Worker* w = it->second;
      if (w->up && std::find(tried.begin(), tried.end(), w) == tried.end() &&
          w->outstanding <= least->outstanding + cfg.affinity_slack) {
        ++affinity_hits;
        return w;
      }
    }
    if (affinity.size() > 100000) affinity.clear();
    affinity[key] = least;
    return least;
  }

  // ---- the request path ----
  static json worker_error(const Worker& w, const std::string& what) {
    return error_body(std::string(w.role()) + " worker " + w.url + " failed: " + what, "server_error", "",
                      "worker_failed");
  }
  // A worker's non-200 answer: a 4xx (the request's fault) as it is; a 5xx as the router's
  // error naming the worker, with the worker's message.
  void answer_error(httplib::Response& res, const Worker& w, int status, const std::string& body) {
    if (status < 500) {
      res.status = status;
      res.set_content(body, "application/json");
      return;
    }
    ++failed;
    std::string msg = "HTTP " + std::to_string(status);
    try {
      msg += ": " + json::parse(body).at("error").at("message").get<std::string>();
    } catch (const std::exception&) {
    }
    send_json(res, status, worker_error(w, msg));
  }
  void fail_worker(Worker& w, const std::string& what) {
    ++w.failures;
    mark_down(w, what);
  }
  std::string new_id(bool chat) {
    return std::string(chat ? "chatcmpl-" : "cmpl-") + "r" + std::to_string(id_base + next_id++);
  }
  static void relabel(json& chunk, const std::string& id, int64_t created, int64_t cached) {
    if (!chunk.is_object()) return;
    if (chunk.contains("id")) chunk["id"] = id;
    if (chunk.contains("created")) chunk["created"] = created;
    if (chunk.contains("usage") && chunk["usage"].is_object() && cached >= 0)
      chunk["usage"]["prompt_tokens_details"] = {{"cached_tokens", cached}};
  }

  // The prefill call's KV event: nothing when the transfer succeeded, else the error body
  // naming the worker at fault (marked down when it is unreachable or broke the connection).
  std::optional<json> await_kv(PrefillCall& call, Worker& p, Worker& d) {
    json kv;
    if (!call.next(kv) || !kv.contains("kv")) {
      std::string terr;
      {
        std::lock_guard<std::mutex> lock(call.m);
        terr = call.transport_error;
      }
      const std::string what = "the stream ended before the KV transfer finished" + (terr.empty() ? "" : ": " + terr);
      fail_worker(p, what);
      return worker_error(p, what);
    }
    const json& k = kv["kv"];
    if (!k.value("ok", false)) {
      const std::string kind = k.value("kind", "");
      const std::string msg = k.value("error", std::string("KV transfer failed"));
      if (kind == "connect" || kind == "io") {
        fail_worker(d, msg);
      } else {
        ++d.failures;
      }
      return worker_error(d, "KV transfer: " + msg);
    }
    kv_seconds.observe(k.value("seconds", 0.0));
    kv_bytes += k.value("bytes", int64_t{0});
    kv_blocks += k.value("blocks", int64_t{0});
    return std::nullopt;
  }
  void handle(const httplib::Request& req, httplib::Response& res, bool chat);
  void relay_decode(Worker& d, const json& decode_body, bool stream, const std::string& id, int64_t created,
                    int64_t cached, bool drop_role, httplib::DataSink* sink, httplib::Response* res);
};

}  // namespace tessera::serve
