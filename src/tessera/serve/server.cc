// The server: engine thread, admission, cancellation, drain, and the HTTP routes.
// Request handlers (OpenAI responses and streams) are in server_routes.cc.
#include "tessera/serve/server_impl.h"

#include <malloc.h>

#include <cstdlib>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>

#include <cstdio>

#include "tessera/base/logging.h"

namespace tessera::serve {

void ServerConfig::validate() const {
  TESSERA_CHECK(port >= 0 && port <= 65535, "--port must be in [0, 65535], got ", port);
  TESSERA_CHECK(!host.empty(), "--host must not be empty");
  TESSERA_CHECK(max_queue >= 0, "--max-queue must be >= 0, got ", max_queue);
  TESSERA_CHECK(request_timeout_s >= 0, "--request-timeout must be >= 0 seconds, got ", request_timeout_s);
  TESSERA_CHECK(max_body_bytes >= 1024, "--max-body-bytes must be >= 1024, got ", max_body_bytes);
  TESSERA_CHECK(grace_period_s >= 0, "--grace-period must be >= 0 seconds, got ", grace_period_s);
  TESSERA_CHECK(http_threads >= 0 && http_threads <= 4096, "--http-threads must be in [0, 4096], got ",
                http_threads);
  TESSERA_CHECK(default_max_tokens >= 1, "default max_tokens must be >= 1");
  select_tool_parser(tool_call_parser, "");  // throws naming the flag for an unknown name
  TESSERA_CHECK(health_timeout_s > 0, "--health-timeout must be > 0 seconds, got ", health_timeout_s);
  TESSERA_CHECK(role.empty() || role == "prefill" || role == "decode", "--role must be prefill or decode, got '",
                role, "'");
  TESSERA_CHECK(kv_port >= 0 && kv_port <= 65535, "--kv-port must be in [0, 65535], got ", kv_port);
  TESSERA_CHECK(kv_transport == "tcp" || kv_transport == "shm", "--kv-transport must be tcp or shm, got '",
                kv_transport, "'");
  TESSERA_CHECK(kv_hold_s > 0, "kv hold must be > 0 seconds");
  for (size_t i = 0; i < loras.size(); ++i) {
    const std::string& name = loras[i].first;
    TESSERA_CHECK(!name.empty(), "--lora ", loras[i].second, ": the adapter name is empty");
    TESSERA_CHECK(name != model_name, "--lora ", name, ": the name is the base model's (", model_name,
                  "); give the adapter another name");
    for (size_t j = 0; j < i; ++j)
      TESSERA_CHECK(loras[j].first != name, "--lora ", name, ": the name is given twice");
  }
}

// ---- Job: one HTTP request's channel from the engine thread -------------------------------

void Job::push(Event e) {
  {
    std::lock_guard<std::mutex> lock(m);
    events.push_back(std::move(e));
  }
  cv.notify_all();
}

void Job::fail(int status, std::string type, std::string code, std::string message, std::string param) {
  {
    std::lock_guard<std::mutex> lock(m);
    if (done) return;
    error = std::make_unique<ApiError>(status, std::move(type), std::move(param), std::move(code), message);
    done = true;
  }
  cv.notify_all();
}

void Job::finish_all() {
  {
    std::lock_guard<std::mutex> lock(m);
    done = true;
  }
  cv.notify_all();
}

// ---- Server::Impl ---------------------------------------------------------------------------

Server::Impl::Impl(const model::Model& model, const infer::EngineConfig& ec, const io::Tokenizer* tok,
                   ChatTemplate tmpl, ServerConfig config, infer::TpGroup* tp)
    : config_(std::move(config)),
      tokenizer_(tok),
      chat_template_(std::move(tmpl)),
      engine_(model, ec, tok, nullptr, tp),
      metrics_(config_.model_name),
      started_(Clock::now()) {
  config_.validate();
  // Two malloc arenas for all HTTP threads (glibc's default is 8 per core): a large body
  // (up to --max-body-bytes) freed by a thread stays in its arena's top chunk, which
  // malloc_trim does not return for non-main arenas, so RSS grew with the number of threads
  // that ever read a big body (measured: 12 threads x 2 MB bodies, 19 -> 81 MB; with 2 arenas
  // 24 MB). Set before the HTTP and engine threads exist.
  if (const char* env = std::getenv("MALLOC_ARENA_MAX"); !env || !*env) mallopt(M_ARENA_MAX, 2);
  info_.name = config_.model_name;
  info_.tokenizer = tok;
  info_.chat_template = &chat_template_;
  info_.max_model_len = engine_.max_model_len();
  info_.streaming = engine_.config().streaming();
  info_.vocab_size = model.config().vocab_size;
  info_.default_max_tokens = config_.default_max_tokens;
  info_.tool_parser = select_tool_parser(config_.tool_call_parser, chat_template_.source());
  TESSERA_CHECK(config_.loras.size() == model.lora_bank().size(), "serve: ", config_.loras.size(),
                " adapter names for the model's ", model.lora_bank().size(), " LoRA adapters");
  for (const auto& l : config_.loras) info_.adapters.push_back(l.first);
  metrics_.update_engine(engine_.stats());
  snapshot_.kv_blocks_total = engine_.stats().kv_blocks_total;
  heartbeat_ns_ = now_ns();
}

int64_t Server::Impl::now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

std::shared_ptr<Job> Server::Impl::submit(ApiRequest req, const std::function<void(Job&)>& prepare) {
  auto job = std::make_shared<Job>();
  job->req = std::move(req);
  if (prepare) prepare(*job);
  job->arrival = Clock::now();
  job->created = static_cast<int64_t>(std::time(nullptr));
  static const char* kPrefix[] = {"cmpl-", "chatcmpl-", "embd-"};  // by Endpoint
  job->id = kPrefix[static_cast<int>(job->req.endpoint)] + std::to_string(next_job_.fetch_add(1)) +
            "-" + std::to_string(started_.time_since_epoch().count() % 1000000007);
  job->remaining = job->req.choices();
  {
    std::lock_guard<std::mutex> lock(inbox_m_);
    if (draining_) throw ApiError(503, "service_unavailable", "", "shutting_down", "the server is shutting down");
    const int64_t queued = static_cast<int64_t>(inbox_.size()) + waiting_.load();
    if (queued >= config_.max_queue)
      throw ApiError(429, "rate_limit_error", "", "queue_full",
                     "the server is at capacity (" + std::to_string(queued) + " requests waiting); retry later");
    inbox_.push_back(job);
    ++in_flight_;
  }
  inbox_cv_.notify_all();
  return job;
}

void Server::Impl::release(const std::shared_ptr<Job>& job, bool cancel) {
  if (cancel && !job->cancel.exchange(true)) {
    std::lock_guard<std::mutex> lock(inbox_m_);
    cancels_.push_back(job);
  }
  inbox_cv_.notify_all();
  if (--in_flight_ == 0) {
    std::lock_guard<std::mutex> lock(drain_m_);  // no lost wake-up for drain_loop
    drain_cv_.notify_all();
  }
}

// ---- the engine thread ------------------------------------------------------------------

void Server::Impl::abort_job(Job& job) {
  for (auto id : job.engine_ids) {
    engine_.abort_request(id);
    active_.erase(id);
  }
  job.engine_ids.clear();
}

void Server::Impl::admit(const std::shared_ptr<Job>& job) {
  if (job->cancel) {
    job->finish_all();
    return;
  }
  try {
    for (size_t p = 0; p < job->req.prompts.size(); ++p) {
      const auto id = !job->resume.empty() ? admit_resumed(*job, p)
                      : job->req.endpoint == Endpoint::kEmbeddings
                          ? engine_.add_embedding_request(job->req.prompts[p], job->req.adapter)
                          : engine_.add_request(job->req.prompts[p], job->req.params, 0, job->req.adapter);
      job->engine_ids.push_back(id);
      active_[id] = {job, static_cast<int64_t>(p)};
    }
    job->choice_last.assign(job->req.choices(), Clock::time_point{});
    jobs_.push_back(job);
    if (job->req.adapter >= 0) metrics_.lora_request(job->req.model);
  } catch (const FieldError& e) {  // checked in parse_request already; kept for safety
    abort_job(*job);
    job->fail(400, "invalid_request_error", "", e.what(), e.field());
  } catch (const std::exception& e) {
    abort_job(*job);
    job->fail(400, "invalid_request_error", "", e.what());
  }
}

void Server::Impl::dispatch(std::vector<infer::RequestOutput>& outs) {
  const auto now = Clock::now();
  for (auto& o : outs) {
    auto it = active_.find(o.id);
    if (it == active_.end()) continue;  // an aborted job's last word
    auto job = it->second.job;
    const int64_t choice = it->second.prompt * job->req.params.n + o.index;
    job->output_tokens += static_cast<int64_t>(o.new_tokens.size());
    if (!o.new_tokens.empty()) {
      auto& last = job->choice_last[choice];
      if (!job->first_token) {
        job->first_token = true;
        metrics_.observe_ttft(std::chrono::duration<double>(now - job->arrival).count());
      } else if (last != Clock::time_point{}) {
        metrics_.observe_inter_token(std::chrono::duration<double>(now - last).count());
      }
      last = now;
    }
    const bool finished = o.finished;
    if (finished) metrics_.request_finished(o.finish_reason);
    job->push({choice, std::move(o)});
    if (finished && --job->remaining == 0) {
      metrics_.observe_e2e(std::chrono::duration<double>(now - job->arrival).count());
      int64_t prompt = 0;
      for (const auto& p : job->req.prompts) prompt += static_cast<int64_t>(p.size());
      metrics_.observe_request_tokens(prompt, job->output_tokens);
      for (auto id : job->engine_ids) active_.erase(id);
      job->engine_ids.clear();
      if (job->kv_export) disagg_job_done(*job);
      job->finish_all();
    }
  }
}

void Server::Impl::engine_loop() {
  std::vector<std::shared_ptr<Job>> incoming, cancelled;
  while (true) {
    {
      std::unique_lock<std::mutex> lock(inbox_m_);
      if (!engine_.has_unfinished() && inbox_.empty() && cancels_.empty() && tasks_.empty() && !stop_engine_ &&
          !cancel_all_)
        inbox_cv_.wait_for(lock, std::chrono::milliseconds(100));
      incoming.assign(inbox_.begin(), inbox_.end());
      inbox_.clear();
      cancelled.swap(cancels_);
      if (stop_engine_ && incoming.empty()) break;
    }
    heartbeat_ns_ = now_ns();
    run_engine_tasks();  // KV transfer bookkeeping (server_disagg.cc)
    if (incoming.empty() && cancelled.empty() && !engine_.has_unfinished()) {
      // Idle: hand freed heap pages back to the system once after each busy spell (glibc keeps
      // them otherwise, and RSS would only ever grow with fragmentation). HTTP traffic the
      // engine never saw (refused bodies) counts as busy too.
      if (const int64_t http = http_done_ns_.load(std::memory_order_relaxed); http > http_seen_ns_) {
        http_seen_ns_ = http;
        busy_since_trim_ = true;
        last_busy_ = std::max(last_busy_, Clock::time_point(std::chrono::nanoseconds(http)));
      }
      if (busy_since_trim_ && Clock::now() - last_busy_ > std::chrono::seconds(1)) {
        malloc_trim(0);
        busy_since_trim_ = false;
      }
    } else {
      busy_since_trim_ = true;
      last_busy_ = Clock::now();
    }
    for (auto& job : incoming) admit(job);
    for (auto& job : cancelled) {
      if (!job->engine_ids.empty())
        for (int64_t i = 0; i < job->remaining; ++i) metrics_.request_finished("abort");
      abort_job(*job);
      job->finish_all();
    }
    cancelled.clear();
    // Timeouts and the end of the drain's grace period.
    const auto now = Clock::now();
    const bool cancel_all = cancel_all_.load();
    for (auto& job : jobs_) {
      if (job->engine_ids.empty()) continue;
      if (cancel_all) {
        abort_job(*job);
        job->fail(503, "service_unavailable", "shutting_down", "the server shut down before the request finished");
      } else if (config_.request_timeout_s > 0 &&
                 now - job->arrival > std::chrono::duration<double>(config_.request_timeout_s)) {
        abort_job(*job);
        metrics_.request_finished("timeout");
        job->fail(408, "timeout_error", "request_timeout",
                  "the request did not finish within the server's " + std::to_string(config_.request_timeout_s) +
                      " s timeout");
      }
    }
    std::erase_if(jobs_, [](const std::shared_ptr<Job>& j) { return j->engine_ids.empty(); });

    if (engine_.has_unfinished()) {
      const auto t0 = Clock::now();
      std::vector<infer::RequestOutput> outs;
      if (config_.debug_step_delay_s > 0)
        std::this_thread::sleep_for(std::chrono::duration<double>(config_.debug_step_delay_s));
      try {
        outs = engine_.step();
      } catch (const std::exception& e) {
        // A bug, not a request's fault: fail what is running and keep serving.
        TESSERA_LOG(kError, "engine step failed: ", e.what());
        for (auto& job : jobs_) {
          abort_job(*job);
          job->fail(500, "internal_error", "", std::string("engine step failed: ") + e.what());
        }
        jobs_.clear();
      }
      last_step_ns_ = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
      for (auto id : engine_.started_last_step()) {
        auto it = active_.find(id);
        if (it != active_.end() && !it->second.job->started) {
          it->second.job->started = true;
          if (it->second.job->transfer_id >= 0) disagg_job_started(*it->second.job);
          metrics_.observe_queue_time(std::chrono::duration<double>(t0 - it->second.job->arrival).count());
        }
      }
      dispatch(outs);
    }
    const auto st = engine_.stats();
    waiting_ = st.waiting;
    metrics_.update_engine(st);
    {
      std::lock_guard<std::mutex> lock(snap_m_);
      snapshot_.running = st.running;
      snapshot_.waiting = st.waiting;
      snapshot_.kv_blocks_used = st.kv_blocks_used;
      snapshot_.kv_blocks_total = st.kv_blocks_total;
      snapshot_.prompt_tokens = st.prompt_tokens;
      snapshot_.generation_tokens = st.generation_tokens;
      snapshot_.steps = st.steps;
      // Throughput over the last ~5 s from (time, total) samples.
      const double t = std::chrono::duration<double>(Clock::now() - started_).count();
      samples_.push_back({t, st.generation_tokens});
      while (samples_.size() > 2 && samples_.front().first < t - 5.0) samples_.pop_front();
      const auto& f = samples_.front();
      snapshot_.tokens_per_s = t - f.first > 0.2 ? (st.generation_tokens - f.second) / (t - f.first) : 0.0;
    }
    heartbeat_ns_ = now_ns();
  }
  // Anything still queued when the engine stops is refused.
  for (auto& job : jobs_) {
    abort_job(*job);
    job->fail(503, "service_unavailable", "shutting_down", "the server shut down before the request finished");
  }
}

bool Server::Impl::healthy() const {
  const double age = (now_ns() - heartbeat_ns_.load()) * 1e-9;
  const double longest = last_step_ns_.load() * 1e-9;
  return age < std::max(config_.health_timeout_s, 5.0 * longest);
}

// ---- run / stop -----------------------------------------------------------------------------

int Server::Impl::run(bool handle_signals) {
  ::signal(SIGPIPE, SIG_IGN);  // a client gone mid-write is an error return, not a signal
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  if (handle_signals) pthread_sigmask(SIG_BLOCK, &set, nullptr);  // inherited by every thread below

  const int64_t threads = config_.http_threads > 0 ? config_.http_threads
                                                    : engine_.config().max_num_seqs + config_.max_queue + 16;
  http_.new_task_queue = [threads] { return new httplib::ThreadPool(static_cast<size_t>(threads)); };
  // Every HTTP thread that tokenizes keeps its own pre-token cache: 32 MiB among them all
  // (at least 64 KiB each, a few thousand pre-tokens), not 32 MiB each.
  if (tokenizer_) tokenizer_->set_piece_cache_bytes(std::max<int64_t>(int64_t{64} << 10, (int64_t{32} << 20) / threads));
  http_.set_payload_max_length(static_cast<size_t>(config_.max_body_bytes));
  http_.set_tcp_nodelay(true);  // SSE chunks are small: no Nagle delay between tokens
  http_.set_keep_alive_timeout(2);  // bounds how long an idle connection delays the drain
  http_.set_read_timeout(30);
  http_.set_write_timeout(30);
  // cpp-httplib listens with a backlog of 5: a burst of clients would see dropped SYNs and
  // 1 s retries. Listening again on the bound socket raises the backlog.
  // Not httplib's default options: they set SO_REUSEPORT, which lets a second server bind a
  // busy port and take half its connections. SO_REUSEADDR only (a restart can rebind a port
  // in TIME_WAIT); a port another process listens on is refused.
  http_.set_socket_options([this](socket_t s) {
    int yes = 1;
    ::setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
    listen_fd_ = s;
  });
  setup_routes();
  const int port = config_.port == 0 ? http_.bind_to_any_port(config_.host)
                                     : (http_.bind_to_port(config_.host, config_.port) ? config_.port : -1);
  if (port <= 0) {
    if (handle_signals) pthread_sigmask(SIG_UNBLOCK, &set, nullptr);
    fail("cannot listen on ", config_.host, ":", config_.port, " (address in use or not available)");
  }
  port_ = port;
  if (listen_fd_ >= 0) ::listen(listen_fd_, SOMAXCONN);
  start_disagg();  // --role: the KV receiver (before any request)
  std::thread engine([this] { engine_loop(); });
  std::thread drainer([this] { drain_loop(); });
  std::thread signals;
  if (handle_signals) {
    signals = std::thread([this, set] {
      int sig = 0;
      sigwait(&set, &sig);
      if (!stopping_) std::fprintf(stderr, "tessera serve: %s: draining\n", sig == SIGTERM ? "SIGTERM" : "SIGINT");
      stop();
    });
  }
  // The start-up summary: what is served, how, and where.
  const model::ModelConfig& mc = engine_.model().config();
  std::fprintf(stderr, "tessera serve: model %s (%s, %.1fM parameters, %s weights), context %lld tokens\n",
               config_.model_name.c_str(), mc.model_type.c_str(), mc.num_parameters() / 1e6,
               dtype_name(engine_.model().dtype()), static_cast<long long>(engine_.max_model_len()));
  std::fprintf(stderr, "tessera serve: chat template: %s\n",
               !tokenizer_ ? "none (no tokenizer: token-id prompts only)"
               : chat_template_.is_fallback()
                   ? "the model has none; ChatML stands in (a base model? its chat replies may be poor)"
                   : "the model's own");
  std::fprintf(stderr, "tessera serve: %s; at most %lld requests running, %lld queued\n",
               engine_.kv_cache_summary().c_str(), static_cast<long long>(engine_.config().max_num_seqs),
               static_cast<long long>(config_.max_queue));
  if (tokenizer_)
    std::fprintf(stderr, "tessera serve: %s\n", tool_parser_summary(config_.tool_call_parser, info_.tool_parser).c_str());
  std::fprintf(stderr, "tessera serve: listening on http://%s:%d\n", config_.host.c_str(), port);
  std::fflush(stderr);
  http_.listen_after_bind();  // until stop(): then waits for the in-flight handlers
  stop();                     // (listen may also end on its own)
  drainer.join();
  stop_disagg();
  {
    std::lock_guard<std::mutex> lock(inbox_m_);
    stop_engine_ = true;
  }
  inbox_cv_.notify_all();
  engine.join();
  if (handle_signals) {
    pthread_kill(signals.native_handle(), SIGTERM);  // wakes sigwait when stop() came from elsewhere
    signals.join();
    pthread_sigmask(SIG_UNBLOCK, &set, nullptr);
  }
  std::fprintf(stderr, "tessera serve: stopped\n");
  return 0;
}

void Server::Impl::stop() {
  {
    std::lock_guard<std::mutex> lock(inbox_m_);
    draining_ = true;
  }
  {
    std::lock_guard<std::mutex> lock(drain_m_);
    if (stopping_) return;
    stopping_ = true;
  }
  drain_cv_.notify_all();
}

// Stops accepting at once, gives in-flight requests the grace period, then cancels the rest.
void Server::Impl::drain_loop() {
  std::unique_lock<std::mutex> lock(drain_m_);
  drain_cv_.wait(lock, [&] { return stopping_; });
  lock.unlock();
  // Not http_.stop(): it also cuts the streams in flight. Shutting the listening socket down
  // makes accept() fail, which ends cpp-httplib's accept loop (it closes the socket); the
  // connections in flight go on, and listen_after_bind() returns once they are done.
  if (listen_fd_ >= 0) ::shutdown(listen_fd_, SHUT_RDWR);
  lock.lock();
  const auto deadline = Clock::now() + std::chrono::duration<double>(config_.grace_period_s);
  drain_cv_.wait_until(lock, deadline, [&] { return in_flight_.load() == 0; });
  if (in_flight_.load() > 0) {
    std::fprintf(stderr, "tessera serve: grace period over; cancelling %lld requests\n",
                 static_cast<long long>(in_flight_.load()));
    cancel_all_ = true;
    inbox_cv_.notify_all();
  }
}

// ---- Server -------------------------------------------------------------------------------

Server::Server(const model::Model& model, const infer::EngineConfig& engine_config, const io::Tokenizer* tokenizer,
               ChatTemplate chat_template, ServerConfig config, infer::TpGroup* tp)
    : impl_(std::make_unique<Impl>(model, engine_config, tokenizer, std::move(chat_template),
                                   std::move(config), tp)) {}
Server::~Server() = default;
int Server::run(bool handle_signals) { return impl_->run(handle_signals); }
void Server::stop() { impl_->stop(); }
int Server::port() const { return impl_->port_.load(); }

}  // namespace tessera::serve
