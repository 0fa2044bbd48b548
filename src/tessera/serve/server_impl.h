// Internals of serve::Server shared by server.cc (engine thread, admission, drain) and
// server_routes.cc (HTTP handlers). Not part of the public interface.
#pragma once
#include <httplib.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <ctime>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "tessera/serve/metrics.h"
#include "tessera/serve/openai.h"
#include "tessera/serve/server.h"

namespace tessera::serve {

using Clock = std::chrono::steady_clock;

struct Event {  // one engine output for one choice
  int64_t choice = 0;
  infer::RequestOutput out;
};

// One HTTP request in flight. The HTTP thread waits on `cv` for events; the engine thread
// pushes them. Fields under "engine thread" are touched by the engine thread only.
struct Job {
  ApiRequest req;
  std::string id;
  int64_t created = 0;
  Clock::time_point arrival;
  std::atomic<bool> cancel{false};

  std::mutex m;
  std::condition_variable cv;
  std::deque<Event> events;         // under m
  bool done = false;                // under m: every choice finished, or failed
  std::unique_ptr<ApiError> error;  // under m: set when failed

  // engine thread
  std::vector<infer::RequestId> engine_ids;  // per prompt; empty once finished or aborted
  int64_t remaining = 0;                     // choices not finished
  bool started = false, first_token = false;
  std::vector<Clock::time_point> choice_last;  // last output time per choice
  int64_t output_tokens = 0;

  // Prefill/decode disaggregation (server_disagg.cc)
  bool kv_export = false;                       // prefill: hold the prompt's KV blocks when done
  std::optional<infer::Engine::KvChain> kv_chain;  // prefill: set by the engine thread, before done
  std::vector<int32_t> resume;                  // decode: the tokens the prefill worker generated
  bool emit_resumed = false;                    // decode: send them as the first output
  int64_t transfer_id = -1;                     // decode: the import this request claims

  void push(Event e);
  void fail(int status, std::string type, std::string code, std::string message, std::string param = "");
  void finish_all();
};

struct Snapshot {  // what GET /stats reports; written by the engine thread
  int64_t running = 0, waiting = 0, kv_blocks_used = 0, kv_blocks_total = 0;
  int64_t prompt_tokens = 0, generation_tokens = 0, steps = 0;
  double tokens_per_s = 0;
};

struct Server::Impl {
  Impl(const model::Model& model, const infer::EngineConfig& ec, const io::Tokenizer* tok, ChatTemplate tmpl,
       ServerConfig config, infer::TpGroup* tp = nullptr);

  int run(bool handle_signals);
  void stop();

  // admission (HTTP threads)
  // throws ApiError 429 / 503; prepare (optional) fills the job in before the engine can see it
  std::shared_ptr<Job> submit(ApiRequest req, const std::function<void(Job&)>& prepare = nullptr);
  void release(const std::shared_ptr<Job>& job, bool cancel);  // the handler is done with it

  // engine thread
  void engine_loop();
  void admit(const std::shared_ptr<Job>& job);
  void abort_job(Job& job);
  void dispatch(std::vector<infer::RequestOutput>& outs);
  void drain_loop();
  bool healthy() const;
  static int64_t now_ns();

  // prefill/decode disaggregation (server_disagg.cc)
  struct Disagg;
  std::shared_ptr<Disagg> disagg_;
  std::deque<std::function<void()>> tasks_;  // under inbox_m_: run by the engine thread
  void start_disagg();
  void stop_disagg();
  void setup_disagg_routes();
  std::string disagg_metrics() const;
  void post_engine_task(std::function<void()> fn);
  void call_on_engine(std::function<void()> fn);  // blocks until the engine thread ran it; throws its error
  void run_engine_tasks();                        // engine thread
  infer::RequestId admit_resumed(Job& job, size_t prompt);  // engine thread
  void disagg_job_done(Job& job);                 // engine thread: a kv_export job's last output
  void disagg_job_started(Job& job);              // engine thread: a claiming job's first step ran
  void handle_kv_prefill(const httplib::Request& req, httplib::Response& res);
  void handle_kv_decode(const httplib::Request& req, httplib::Response& res);
  // The SSE "data:" payloads stream_response would write for `events` (no [DONE]) and the
  // non-streaming response they add up to.
  void render_events(const Job& job, const std::deque<Event>& events, std::vector<std::string>& chunks,
                     std::string& usage_chunk, nlohmann::json& full);

  // routes (server_routes.cc)
  void setup_routes();
  void handle_generate(const httplib::Request& req, httplib::Response& res, Endpoint endpoint);
  void stream_response(const std::shared_ptr<Job>& job, httplib::Response& res);
  void full_response(const std::shared_ptr<Job>& job, httplib::Response& res);
  // server_api.cc: GET /v1/models, GET /v1/models/{id}, POST /v1/embeddings. `guard` wraps a
  // handler as setup_routes' other /v1 routes are (errors to OpenAI error bodies).
  using Handler = std::function<void(const httplib::Request&, httplib::Response&)>;
  void setup_api_routes(const std::function<Handler(Handler)>& guard);
  nlohmann::json model_cards() const;  // the base model, then each LoRA adapter (vLLM's fields)
  void handle_embeddings(const httplib::Request& req, httplib::Response& res);

  ServerConfig config_;
  const io::Tokenizer* tokenizer_;
  ChatTemplate chat_template_;
  infer::Engine engine_;
  ServerMetrics metrics_;
  ModelInfo info_;
  Clock::time_point started_;
  int64_t started_unix_ = static_cast<int64_t>(std::time(nullptr));  // the models' "created"
  httplib::Server http_;
  std::atomic<int> port_{0};
  int listen_fd_ = -1;

  std::mutex inbox_m_;
  std::condition_variable inbox_cv_;
  std::deque<std::shared_ptr<Job>> inbox_;           // submitted, not yet given to the engine
  std::vector<std::shared_ptr<Job>> cancels_;        // to abort
  bool draining_ = false, stop_engine_ = false;      // under inbox_m_
  std::atomic<int64_t> waiting_{0};                  // the engine's waiting requests
  std::atomic<int64_t> in_flight_{0};                // submitted and not released
  std::atomic<int64_t> next_job_{1};
  std::atomic<bool> cancel_all_{false};

  std::mutex drain_m_;
  std::condition_variable drain_cv_;
  bool stopping_ = false;  // under drain_m_

  // engine thread
  struct Active {
    std::shared_ptr<Job> job;
    int64_t prompt = 0;
  };
  std::unordered_map<infer::RequestId, Active> active_;
  std::vector<std::shared_ptr<Job>> jobs_;  // admitted and not finished
  std::atomic<int64_t> heartbeat_ns_{0}, last_step_ns_{0};
  bool busy_since_trim_ = false;
  Clock::time_point last_busy_;
  // now_ns() when an HTTP handler last finished (any route, any status): requests refused
  // before reaching the engine (a 2 MB hostile body) also leave freed heap to trim.
  std::atomic<int64_t> http_done_ns_{0};
  int64_t http_seen_ns_ = 0;  // engine thread: the last http_done_ns_ it counted as busy

  std::mutex snap_m_;
  Snapshot snapshot_;
  std::deque<std::pair<double, int64_t>> samples_;  // (seconds since start, generation tokens)
};

}  // namespace tessera::serve
