// `tessera router`'s HTTP server: routes, auth, metrics, the health-check thread, signals.
#include "tessera/serve/router_impl.h"

namespace tessera::serve {

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
