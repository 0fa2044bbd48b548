// `tessera router`: the OpenAI-compatible front of prefill/decode disaggregation (docs/serving.md).
// Each request goes to a prefill worker (least outstanding requests, with prefix-cache affinity:
// a hash of the prompt's first blocks maps to the worker that saw it), whose first token is
// streamed back at once while the prompt's KV blocks move to a decode worker (least outstanding);
// the decode worker then streams the rest. Workers are health-checked (/health, /kv/info); a
// worker that fails is marked down at once, fails only its own requests (5xx naming it), and
// comes back when healthy.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace tessera::serve {

struct RouterConfig {
  std::string host = "127.0.0.1";
  int port = 8000;                    // 0 = any free port (printed on stderr once bound)
  std::vector<std::string> prefill;   // worker URLs, http://HOST:PORT (`tessera serve --role prefill`)
  std::vector<std::string> decode;    // (`tessera serve --role decode`)
  std::string kv_transport = "tcp";   // tcp | shm (decode workers started with --kv-transport shm, same host)
  std::string api_key;                // as tessera serve's: every /v1 route needs it
  double health_interval_s = 0.5;     // between health checks of each worker
  double request_timeout_s = 600;     // per worker call
  int64_t http_threads = 512;
  int64_t affinity_blocks = 4;        // the affinity key hashes the prompt's first this many blocks
  int64_t affinity_slack = 4;         // ...and wins unless its worker has this many more requests in flight
  bool log_requests = false;
  void validate() const;              // throws naming the flag
};

class Router {
 public:
  explicit Router(RouterConfig config);
  ~Router();
  Router(const Router&) = delete;
  Router& operator=(const Router&) = delete;
  // Binds (throws when the address is taken), checks the workers once, prints "listening on
  // http://HOST:PORT" on stderr and serves until stop() or SIGTERM / SIGINT; returns 0.
  int run(bool handle_signals = true);
  void stop();
  int port() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// "http://host:port[/]" -> (host, port); throws naming `flag` and the URL otherwise.
std::pair<std::string, int> parse_worker_url(const std::string& url, const std::string& flag);

}  // namespace tessera::serve
