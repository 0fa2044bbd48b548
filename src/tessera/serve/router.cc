// `tessera router` (router.h): worker health, routing by load and prefix affinity, and the
// request path: prefill call (first token streamed at once, KV transfer reported), then the
// decode call whose stream is relayed with the router's ids.
#include "tessera/serve/router.h"

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
#include "tessera/serve/openai.h"
#include "tessera/serve/prom_histogram.h"

namespace tessera::serve {
namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

void send_json(httplib::Response& res, int status, const json& body) {
  res.status = status;
  res.set_content(dump(body), "application/json");
}

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

std::unique_ptr<httplib::Client> client_for(const Worker& w, double timeout_s) {
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

}  // namespace

std::pair<std::string, int> parse_worker_url(const std::string& url, const std::string& flag) {
  std::string rest = url;
  TESSERA_CHECK(rest.rfind("http://", 0) == 0, flag, " ", url, ": expected http://HOST:PORT");
  rest = rest.substr(7);
  while (!rest.empty() && rest.back() == '/') rest.pop_back();
  const size_t colon = rest.rfind(':');
  TESSERA_CHECK(colon != std::string::npos && colon > 0 && colon + 1 < rest.size() &&
                    rest.find('/') == std::string::npos,
                flag, " ", url, ": expected http://HOST:PORT");
  int port = 0;
  try {
    size_t used = 0;
    port = std::stoi(rest.substr(colon + 1), &used);
    TESSERA_CHECK(used == rest.size() - colon - 1, "bad port");
  } catch (const std::exception&) {
    port = -1;
  }
  TESSERA_CHECK(port > 0 && port <= 65535, flag, " ", url, ": the port must be in [1, 65535]");
  return {rest.substr(0, colon), port};
}

void RouterConfig::validate() const {
  TESSERA_CHECK(!prefill.empty(), "--prefill: give at least one prefill worker URL");
  TESSERA_CHECK(!decode.empty(), "--decode: give at least one decode worker URL");
  for (const auto& u : prefill) parse_worker_url(u, "--prefill");
  for (const auto& u : decode) parse_worker_url(u, "--decode");
  TESSERA_CHECK(port >= 0 && port <= 65535, "--port must be in [0, 65535], got ", port);
  TESSERA_CHECK(kv_transport == "tcp" || kv_transport == "shm", "--kv-transport must be tcp or shm, got '",
                kv_transport, "'");
  TESSERA_CHECK(health_interval_s > 0, "--health-interval must be > 0 seconds");
  TESSERA_CHECK(request_timeout_s > 0, "--request-timeout must be > 0 seconds");
  TESSERA_CHECK(http_threads >= 1 && http_threads <= 4096, "--http-threads must be in [1, 4096]");
  TESSERA_CHECK(affinity_blocks >= 1, "--affinity-blocks must be >= 1");
  TESSERA_CHECK(affinity_slack >= 0, "--affinity-slack must be >= 0");
}

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

void Router::Impl::handle(const httplib::Request& req, httplib::Response& res, bool chat) {
  ++requests;
  const json body = parse_body(req.body);
  if (!body.is_object()) bad_request("", "the request body must be a JSON object");
  auto present = [&](const char* k) { return body.contains(k) && !body[k].is_null(); };
  if (present("n") && !(body["n"].is_number_integer() && body["n"].get<int64_t>() == 1))
    bad_request("n", "the disaggregated router serves n = 1 only");
  if (present("best_of") && !(body["best_of"].is_number_integer() && body["best_of"].get<int64_t>() == 1))
    bad_request("best_of", "the disaggregated router serves best_of = 1 only");
  if (present("use_beam_search") && body["use_beam_search"] != false)
    bad_request("use_beam_search", "beam search is not served by the disaggregated router");
  if ((present("logprobs") && body["logprobs"] != false) || present("top_logprobs"))
    bad_request(present("logprobs") ? "logprobs" : "top_logprobs", "logprobs are not served by the disaggregated router yet");
  if (!chat && body.contains("prompt") && body["prompt"].is_array() && !body["prompt"].empty() &&
      (body["prompt"][0].is_string() || body["prompt"][0].is_array()))
    bad_request("prompt", "the disaggregated router serves one prompt per request (not a batch)");
  const bool stream = body.value("stream", false) == true;
  // Stop strings: the decode worker sends the first token too (its stop-string check sees it).
  const bool decode_emits = present("stop") && !(body["stop"].is_array() && body["stop"].empty());
  const int64_t bs = prefills.front()->block_size.load();
  const uint64_t key = affinity_key(body, cfg.affinity_blocks * bs);

  std::vector<Worker*> tried;
  Worker* p = nullptr;
  Worker* d = nullptr;
  std::unique_ptr<PrefillCall> call;
  std::shared_ptr<Counted> d_busy;  // the decode worker's count, from its pick to the end of its stream
  json first;
  const int64_t transfer_id = id_base + next_id++;
  while (true) {
    p = pick_prefill(key, tried);
    {
      std::lock_guard<std::mutex> lock(pick_m);  // pick and count at once: concurrent picks spread
      d = least_loaded(decodes, {});
      if (d) d_busy = std::make_shared<Counted>(*d);
    }
    if (!p || !d) {
      ++failed;
      throw ApiError(503, "service_unavailable", "", "no_worker",
                     std::string("no live ") + (!p ? "prefill" : "decode") + " worker" +
                         (tried.empty() ? "" : " (tried " + std::to_string(tried.size()) + ")"));
    }
    const json pb = {{"request", body},
                     {"endpoint", chat ? "chat" : "completions"},
                     {"transfer_id", transfer_id},
                     {"decode", {{"host", d->host}, {"port", d->kv_port.load()}, {"transport", cfg.kv_transport},
                                 {"worker", d->url}}}};
    ++p->requests;
    call = std::make_unique<PrefillCall>();
    {
      Counted busy(*p);
      call->start(*p, dump(pb), cfg.request_timeout_s);
      if (call->next(first)) break;
    }
    std::string terr;
    int status = 0;
    {
      std::lock_guard<std::mutex> lock(call->m);
      terr = call->transport_error;
      status = call->status;
    }
    if (status != 0 && status != 200) {  // the worker answered: a request error, passed on as is
      res.status = status;
      res.set_content(call->error_body, "application/json");
      return;
    }
    const bool never_answered = status == 0;
    fail_worker(*p, terr.empty() ? "the stream ended before the first token" : terr);
    if (!never_answered) {
      ++failed;
      send_json(res, 502, worker_error(*p, terr.empty() ? "the stream ended before the first token" : terr));
      return;
    }
    tried.push_back(p);  // nothing reached it: try another
  }
  if (first.contains("error")) {
    const int status = first.value("status", 500);
    json e = first;
    e.erase("status");
    send_json(res, status, e);
    return;
  }
  const bool finished = first.value("finished", true);
  const std::string id = new_id(chat);
  const int64_t created = static_cast<int64_t>(std::time(nullptr));
  const int64_t cached = first.value("cached_tokens", int64_t{0});
  json decode_body;
  if (!finished)
    decode_body = {{"request", body},
                   {"endpoint", chat ? "chat" : "completions"},
                   {"prompt_token_ids", first.at("prompt_token_ids")},
                   {"generated", json::array({first.at("token")})},
                   {"transfer_id", transfer_id},
                   {"emit_generated", decode_emits || !stream}};
  if (cfg.log_requests)
    std::fprintf(stderr, "tessera router: %s: prefill %s, decode %s%s\n", id.c_str(), p->url.c_str(), d->url.c_str(),
                 finished ? " (ended at the first token)" : "");
  if (!stream) {
    if (finished) {
      json full = first.at("full");
      relabel(full, id, created, -1);
      send_json(res, 200, full);
      return;
    }
    if (auto err = await_kv(*call, *p, *d)) {
      ++failed;
      send_json(res, 502, *err);
      return;
    }
    relay_decode(*d, decode_body, false, id, created, cached, false, nullptr, &res);
    return;
  }
  res.set_header("Cache-Control", "no-cache");
  res.set_header("X-Accel-Buffering", "no");
  auto shared_call = std::shared_ptr<PrefillCall>(call.release());
  res.set_chunked_content_provider(
      "text/event-stream",
      [this, first, finished, decode_emits, id, created, cached, decode_body, shared_call, d, p, d_busy](
          size_t, httplib::DataSink& sink) {
        auto write = [&](const std::string& s) { return sink.write(s.data(), s.size()); };
        auto event = [&](const json& j) { return write("data: " + dump(j) + "\n\n"); };
        if (finished || !decode_emits) {
          for (json c : first.at("chunks")) {  // the first token, at once
            relabel(c, id, created, cached);
            if (!finished && c.contains("choices"))
              for (auto& ch : c["choices"]) ch["finish_reason"] = nullptr;
            if (!event(c)) return false;
          }
        }
        if (finished) {
          if (first.contains("usage_chunk") && !first["usage_chunk"].is_null()) {
            json u = first["usage_chunk"];
            relabel(u, id, created, cached);
            event(u);
          }
          write("data: [DONE]\n\n");
          sink.done();
          return true;
        }
        if (auto err = await_kv(*shared_call, *p, *d)) {
          ++failed;
          event(*err);
          write("data: [DONE]\n\n");
          sink.done();
          return true;
        }
        relay_decode(*d, decode_body, true, id, created, cached, !decode_emits, &sink, nullptr);
        sink.done();
        return true;
      });
}

// The decode worker's answer relayed: a stream's chunks with the router's id (and, when the
// first token's chunks went out already, without a second assistant-role chunk), or the full
// response. A failure is an error naming the worker (502, or an error event mid-stream).
void Router::Impl::relay_decode(Worker& d, const json& decode_body, bool stream, const std::string& id,
                                int64_t created, int64_t cached, bool drop_role, httplib::DataSink* sink,
                                httplib::Response* res) {
  ++d.requests;
  auto c = client_for(d, cfg.request_timeout_s);
  json b = decode_body;
  if (!stream) {
    auto r = c->Post("/kv/decode", dump(b), "application/json");
    if (!r) {
      ++failed;
      fail_worker(d, httplib::to_string(r.error()));
      send_json(*res, 502, worker_error(d, httplib::to_string(r.error())));
      return;
    }
    if (r->status != 200) {
      if (r->status >= 500) ++failed;
      res->status = r->status;
      res->set_content(r->body, "application/json");
      return;
    }
    json full;
    try {
      full = json::parse(r->body);
    } catch (const std::exception&) {
      send_json(*res, 502, worker_error(d, "the response is not JSON"));
      return;
    }
    relabel(full, id, created, cached);
    send_json(*res, 200, full);
    return;
  }
  httplib::Request hr;
  hr.method = "POST";
  hr.path = "/kv/decode";
  hr.body = dump(b);
  hr.set_header("Content-Type", "application/json");
  int status = 0;
  std::string error_text;
  bool done = false, client_gone = false;
  SseParser sse;
  hr.response_handler = [&](const httplib::Response& r) {
    status = r.status;
    return true;
  };
  hr.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    if (status != 200) {
      if (error_text.size() < 65536) error_text.append(data, n);
      return true;
    }
    sse.feed(std::string_view(data, n), [&](const std::string& ev) {
      if (client_gone || done) return;
      if (ev == "[DONE]") {
        done = true;
        return;
      }
      json j;
      try {
        j = json::parse(ev);
      } catch (const std::exception&) {
        return;
      }
      if (drop_role && j.contains("choices") && j["choices"].size() == 1) {
        const json& ch = j["choices"][0];
        if (ch.contains("delta") && ch["delta"].contains("role") && ch["finish_reason"].is_null() &&
            ch["delta"].value("content", std::string()).empty())
          return;  // the prefill worker's chunks carried the role
      }
      relabel(j, id, created, cached);
      const std::string out = "data: " + dump(j) + "\n\n";
      if (!sink->write(out.data(), out.size())) client_gone = true;
    });
    return !client_gone;  // a vanished client cancels the decode worker's request too
  };
  auto r = c->send(hr);
  if (client_gone) return;
  std::string what;
  if (status != 0 && status != 200) {
    json e;
    try {
      e = json::parse(error_text);
    } catch (const std::exception&) {
      e = worker_error(d, "HTTP " + std::to_string(status));
    }
    const std::string out = "data: " + dump(e) + "\n\n";
    sink->write(out.data(), out.size());
  } else if (!done) {
    what = r ? std::string("the stream ended before data: [DONE]") : httplib::to_string(r.error());
    ++failed;
    fail_worker(d, what);
    const std::string out = "data: " + dump(worker_error(d, what)) + "\n\n";
    sink->write(out.data(), out.size());
  }
  const std::string end = "data: [DONE]\n\n";
  sink->write(end.data(), end.size());
}

// ---- Router ---------------------------------------------------------------------------------

Router::Router(RouterConfig config) : impl_(std::make_unique<Impl>(std::move(config))) {}
Router::~Router() = default;
int Router::port() const { return impl_->port.load(); }

void Router::stop() {
  auto& m = *impl_;
  {
    std::lock_guard<std::mutex> lock(m.stop_m);
    m.stopping = true;
  }
  m.stop_cv.notify_all();
  m.http.stop();
}

int Router::run(bool handle_signals) {
  auto& m = *impl_;
  ::signal(SIGPIPE, SIG_IGN);
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  if (handle_signals) pthread_sigmask(SIG_BLOCK, &set, nullptr);
  const int64_t threads = m.cfg.http_threads;
  m.http.new_task_queue = [threads] { return new httplib::ThreadPool(static_cast<size_t>(threads)); };
  m.http.set_tcp_nodelay(true);
  m.http.set_read_timeout(30);
  m.http.set_write_timeout(30);
  m.http.set_payload_max_length(8 << 20);
  auto guarded = [&m](bool chat) {
    return [&m, chat](const httplib::Request& req, httplib::Response& res) {
      if (!m.cfg.api_key.empty() && req.get_header_value("Authorization") != "Bearer " + m.cfg.api_key) {
        send_json(res, 401, error_body("missing or incorrect API key", "invalid_request_error", "", "invalid_api_key"));
        return;
      }
      try {
        m.handle(req, res, chat);
      } catch (const ApiError& e) {
        send_json(res, e.status, error_body(e.what(), e.type, e.param, e.code));
      } catch (const FieldError& e) {
        send_json(res, 400, error_body(e.what(), "invalid_request_error", e.field(), ""));
      } catch (const std::exception& e) {
        send_json(res, 500, error_body(std::string("internal error: ") + e.what(), "internal_error", "", ""));
      }
    };
  };
  m.http.Post("/v1/completions", guarded(false));
  m.http.Post("/v1/chat/completions", guarded(true));
  m.http.Get("/v1/models", [&m](const httplib::Request&, httplib::Response& res) {
    for (auto* list : {&m.decodes, &m.prefills})
      for (auto& w : *list) {
        if (!w->up) continue;
        auto r = client_for(*w, 5)->Get("/v1/models");
        if (r && r->status == 200) {
          res.set_content(r->body, "application/json");
          return;
        }
      }
    send_json(res, 503, error_body("no live worker", "service_unavailable", "", "no_worker"));
  });
  m.http.Get("/health", [&m](const httplib::Request&, httplib::Response& res) {
    auto any = [](auto& list) {
      for (auto& w : list)
        if (w->up) return true;
      return false;
    };
    if (any(m.prefills) && any(m.decodes)) {
      res.set_content("ok\n", "text/plain");
    } else {
      send_json(res, 503, error_body(std::string("no live ") + (any(m.prefills) ? "decode" : "prefill") + " worker",
                                     "service_unavailable", "", "no_worker"));
    }
  });
  m.http.Get("/workers", [&m](const httplib::Request&, httplib::Response& res) {
    json list = json::array();
    for (auto* ws : {&m.prefills, &m.decodes})
      for (auto& w : *ws) {
        std::lock_guard<std::mutex> lock(w->m);
        list.push_back({{"url", w->url}, {"role", w->role()}, {"up", w->up.load()},
                        {"outstanding", w->outstanding.load()}, {"requests", w->requests.load()},
                        {"failures", w->failures.load()}, {"last_error", w->last_error}});
      }
    send_json(res, 200, {{"workers", list}});
  });
  m.http.Get("/metrics", [&m](const httplib::Request&, httplib::Response& res) {
    std::string o = m.kv_seconds.render("tessera_router_kv_transfer_seconds",
                                        "KV transfer time per request as the prefill worker measured it", "");
    auto line = [&](const std::string& name, const char* type, const std::string& labels, int64_t v) {
      o += name + (labels.empty() ? "" : "{" + labels + "}") + " " + std::to_string(v) + "\n";
      (void)type;
    };
    o += "# TYPE tessera_router_kv_transfer_bytes_total counter\n";
    line("tessera_router_kv_transfer_bytes_total", "counter", "", m.kv_bytes.load());
    o += "# TYPE tessera_router_kv_transfer_blocks_total counter\n";
    line("tessera_router_kv_transfer_blocks_total", "counter", "", m.kv_blocks.load());
    o += "# TYPE tessera_router_requests_total counter\n";
    line("tessera_router_requests_total", "counter", "", m.requests.load());
    o += "# TYPE tessera_router_failed_requests_total counter\n";
    line("tessera_router_failed_requests_total", "counter", "", m.failed.load());
    o += "# TYPE tessera_router_prefix_affinity_hits_total counter\n";
    line("tessera_router_prefix_affinity_hits_total", "counter", "", m.affinity_hits.load());
    o += "# TYPE tessera_router_worker_up gauge\n";
    for (auto* ws : {&m.prefills, &m.decodes})
      for (auto& w : *ws)
        line("tessera_router_worker_up", "gauge", "worker=\"" + w->url + "\",role=\"" + w->role() + "\"", w->up ? 1 : 0);
    o += "# TYPE tessera_router_worker_requests_total counter\n";
    for (auto* ws : {&m.prefills, &m.decodes})
      for (auto& w : *ws)
        line("tessera_router_worker_requests_total", "counter", "worker=\"" + w->url + "\",role=\"" + w->role() + "\"",
             w->requests.load());
    res.set_content(o, "text/plain; version=0.0.4; charset=utf-8");
  });

  const int port = m.cfg.port == 0 ? m.http.bind_to_any_port(m.cfg.host)
                                   : (m.http.bind_to_port(m.cfg.host, m.cfg.port) ? m.cfg.port : -1);
  if (port <= 0) {
    if (handle_signals) pthread_sigmask(SIG_UNBLOCK, &set, nullptr);
    fail("cannot listen on ", m.cfg.host, ":", m.cfg.port, " (address in use or not available)");
  }
  m.port = port;
  m.check_all();
  std::thread health([&m] { m.health_loop(); });
  std::thread signals;
  if (handle_signals)
    signals = std::thread([this, set] {
      int sig = 0;
      sigwait(&set, &sig);
      stop();
    });
  std::fprintf(stderr, "tessera router: %zu prefill, %zu decode workers, KV transport %s\n", m.prefills.size(),
               m.decodes.size(), m.cfg.kv_transport.c_str());
  std::fprintf(stderr, "tessera router: listening on http://%s:%d\n", m.cfg.host.c_str(), port);
  std::fflush(stderr);
  m.http.listen_after_bind();
  stop();
  health.join();
  if (handle_signals) {
    pthread_kill(signals.native_handle(), SIGTERM);
    signals.join();
    pthread_sigmask(SIG_UNBLOCK, &set, nullptr);
  }
  std::fprintf(stderr, "tessera router: stopped\n");
  return 0;
}

}  // namespace tessera::serve
