// `tessera serve`: an OpenAI-compatible HTTP server (cpp-httplib) in front of one inference
// engine. HTTP threads parse and validate requests and hand them to the engine thread, which
// owns the Engine and steps it; outputs flow back to each request's stream (SSE or one JSON
// body). Metrics for Prometheus, admission control, auth, timeouts, cancellation on client
// disconnect, and a graceful SIGTERM drain. See docs/serving.md.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tessera/infer/engine.h"
#include "tessera/io/tokenizer.h"
#include "tessera/model/model.h"
#include "tessera/serve/chat_template.h"

namespace tessera::serve {

struct ServerConfig {
  std::string host = "127.0.0.1";  // --host; 0.0.0.0 to expose
  int port = 8000;                 // 0 = any free port (printed on stderr once bound)
  std::string api_key;             // non-empty: every /v1 route needs "Authorization: Bearer KEY"
  std::string model_name;          // the id clients pass as "model" (default: the directory name)
  // Multi-LoRA serving (--lora NAME=DIR): (name, adapter directory) of each adapter of the
  // model's lora_bank(), in bank order. A request whose "model" is NAME runs on that adapter.
  std::vector<std::pair<std::string, std::string>> loras;
  int64_t max_queue = 256;         // requests waiting for the engine at most; beyond: 429
  double request_timeout_s = 600;  // per request, from arrival; 0 = none
  int64_t max_body_bytes = 8 << 20;  // larger bodies: 413
  double grace_period_s = 30;      // SIGTERM: in-flight requests get this long, then are cancelled
  int64_t http_threads = 0;        // 0 = max_num_seqs + max_queue + 16 (a streaming request holds one)
  int64_t default_max_tokens = 16; // completions without max_tokens (OpenAI's default)
  bool log_requests = false;       // one line per request on stderr
  // --tool-call-parser: hermes | llama3_json | none | auto (from the chat template's text)
  std::string tool_call_parser = "auto";
  double health_timeout_s = 10;    // /health is 503 when the engine loop has not come round for
                                   // max(this, 5 x its last step)
  // Prefill/decode disaggregation (docs/serving.md, server_disagg.cc): "" (colocated),
  // "prefill" (runs prompts for `tessera router`, pushes their KV blocks to a decode worker) or
  // "decode" (receives KV blocks, continues requests from their first token).
  std::string role;
  int kv_port = 0;                   // decode: the KV receiver's port (0 = any free port)
  std::string kv_transport = "tcp";  // decode: "tcp", or "shm" (the KV pool in shared memory; tcp works too)
  double kv_hold_s = 60;             // decode: imported blocks stay pinned this long for their request
  // Tests only (env TESSERA_SERVE_STEP_DELAY_MS): each engine step is this much slower, to
  // stand in for a real model's step time with a tiny one.
  double debug_step_delay_s = 0;
  void validate() const;           // throws naming the field
};

class Server {
 public:
  // tokenizer may be null (token-id prompts only; text fields are empty and chat is refused).
  // tp: the tensor-parallel group when `model` is rank 0's shard (infer/tp_serving.h).
  Server(const model::Model& model, const infer::EngineConfig& engine_config,
         const io::Tokenizer* tokenizer, ChatTemplate chat_template, ServerConfig config,
         infer::TpGroup* tp = nullptr);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Binds (throws tessera::Error when the address is taken), prints "listening on
  // http://HOST:PORT" on stderr, starts the engine thread, and serves until stop() or, when
  // handle_signals, SIGTERM / SIGINT; then drains (grace period) and returns 0.
  int run(bool handle_signals = true);
  // From any thread: stop accepting and drain as on SIGTERM.
  void stop();
  int port() const;  // the bound port, after run() has bound it (0 before)

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tessera::serve
