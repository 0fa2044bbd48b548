// `tessera serve --role prefill|decode`: the worker side of prefill/decode disaggregation
// (docs/serving.md). A prefill worker runs a router's request to its first token (POST
// /kv/prefill), streams that token back at once, then pushes the prompt's full KV blocks to the
// decode worker the router chose (serve/kv_transfer.h). A decode worker receives them into its
// pool as prefix-cache blocks (pinned until their request starts) and continues the request from
// its first token (POST /kv/decode), so its prompt is a full prefix-cache hit.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <future>
#include <map>

#include "tessera/base/logging.h"
#include "tessera/infer/kv_shm.h"
#include "tessera/serve/http_reply.h"
#include "tessera/serve/kv_transfer.h"
#include "tessera/serve/prom_histogram.h"
#include "tessera/serve/server_impl.h"

namespace tessera::serve {
namespace {

using nlohmann::json;

// The routes' error handling (as server_routes.cc's guarded handlers); a body that is not
// the JSON the KV routes expect is a 400 too.
template <class F>
void guard(httplib::Response& res, F&& fn) {
  try {
    fn();
  } catch (const nlohmann::json::exception& e) {
    send_error(res, ApiError(400, "invalid_request_error", "", "", std::string("malformed KV request: ") + e.what()));
  } catch (...) {
    send_error(res, api_error_of(std::current_exception()));
  }
}

Endpoint endpoint_of(const json& b) {
  auto it = b.find("endpoint");
  if (it == b.end() || !it->is_string() || (*it != "chat" && *it != "completions"))
    bad_request("endpoint", "endpoint must be \"chat\" or \"completions\"");
  return *it == "chat" ? Endpoint::kChat : Endpoint::kCompletions;
}

// A worker route's body {"endpoint", "request", ...}: the client's request, parsed as a
// colocated server parses it; disaggregated serving runs one prompt with n = 1.
ApiRequest parse_worker_request(const json& b, const ModelInfo& info) {
  if (!b.is_object() || !b.contains("request")) bad_request("request", "the body must hold the client's request");
  ApiRequest r = parse_request(b.at("request"), endpoint_of(b), info);
  if (r.prompts.size() != 1 || r.params.n != 1)
    bad_request(r.prompts.size() != 1 ? "prompt" : "n", "disaggregated serving runs one prompt with n = 1");
  return r;
}

std::vector<int32_t> token_list(const json& b, const char* key, int64_t vocab) {
  auto it = b.find(key);
  if (it == b.end() || !it->is_array()) bad_request(key, std::string(key) + " must be a list of token ids");
  std::vector<int32_t> out;
  for (const auto& t : *it) {
    if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() >= vocab)
      bad_request(key, std::string(key) + " must hold token ids in [0, " + std::to_string(vocab) + ")");
    out.push_back(t.get<int32_t>());
  }
  return out;
}

}  // namespace

struct Server::Impl::Disagg : KvImportSink {
  explicit Disagg(Server::Impl& s) : s(s) {}
  Server::Impl& s;
  std::unique_ptr<infer::KvShmLayout> shm;
  std::unique_ptr<KvReceiver> receiver;
  // engine thread only
  struct Import {
    infer::Engine::KvChain chain;
    std::vector<int32_t> tokens;
    std::chrono::steady_clock::time_point deadline;
  };
  std::map<int64_t, Import> imports;  // reserved, being written
  std::map<int64_t, Import> holds;    // committed, pinned until their request starts
  // metrics
  PromHistogram seconds;
  std::atomic<int64_t> bytes{0}, blocks{0}, transfers{0}, failures{0};

  Reservation reserve(int64_t id, const std::vector<int32_t>& tokens, int32_t adapter,
                      const std::vector<uint64_t>& hashes) override {
    auto out = std::make_shared<Reservation>();
    auto ok = std::make_shared<bool>(false);
    const int64_t total = s.engine_.stats().kv_blocks_total;
    s.call_on_engine([this, id, tokens, adapter, hashes, out, ok] {
      if (imports.count(id) || holds.count(id)) fail("transfer ", id, " is already in progress");
      auto chain = s.engine_.reserve_kv_import(tokens, adapter, hashes);
      if (!chain) return;
      *ok = true;
      out->have = chain->have;
      out->blocks = chain->blocks;
      imports[id] = {*chain, tokens, std::chrono::steady_clock::now() + std::chrono::seconds(600)};
    });
    if (!*ok)
      fail("no room for ", hashes.size(), " KV blocks (the pool holds ", total, ", all in use)");
    return *out;
  }
  // Posted, not waited for: the router sends the request that claims the blocks only after the
  // ack, so the engine thread runs this task before it admits that request (tasks run before
  // admissions in each loop).
  void commit(int64_t id, int64_t n, int64_t b, double secs) override {
    s.post_engine_task([this, id] {
      auto it = imports.find(id);
      if (it == imports.end()) return;
      s.engine_.commit_kv_import(it->second.chain, it->second.tokens);
      it->second.deadline = std::chrono::steady_clock::now() +
                            std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                std::chrono::duration<double>(s.config_.kv_hold_s));
      holds[id] = std::move(it->second);
      imports.erase(it);
    });
    bytes += b;
    blocks += n;
    ++transfers;
    seconds.observe(secs);
  }
  void abort(int64_t id, bool failed) override {
    if (failed) ++failures;
    s.post_engine_task([this, id] {
      auto it = imports.find(id);
      if (it == imports.end()) return;
      s.engine_.release_kv(it->second.chain.holder);
      imports.erase(it);
    });
  }
  infer::KvPool& pool() override { return s.engine_.kv_pool(); }
};

void Server::Impl::post_engine_task(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lock(inbox_m_);
    tasks_.push_back(std::move(fn));
  }
  inbox_cv_.notify_all();
}

void Server::Impl::call_on_engine(std::function<void()> fn) {
  auto done = std::make_shared<std::promise<void>>();
  auto fut = done->get_future();
  post_engine_task([fn = std::move(fn), done] {
    try {
      fn();
      done->set_value();
    } catch (...) {
      done->set_exception(std::current_exception());
    }
  });
  if (fut.wait_for(std::chrono::seconds(60)) != std::future_status::ready)
    fail("the engine thread did not take the KV transfer within 60 s");
  fut.get();
}

void Server::Impl::run_engine_tasks() {
  std::deque<std::function<void()>> tasks;
  {
    std::lock_guard<std::mutex> lock(inbox_m_);
    tasks.swap(tasks_);
  }
  for (auto& t : tasks) t();
  if (!disagg_) return;
  const auto now = std::chrono::steady_clock::now();
  for (auto* m : {&disagg_->holds, &disagg_->imports})
    for (auto it = m->begin(); it != m->end();) {
      if (now < it->second.deadline) {
        ++it;
        continue;
      }
      engine_.release_kv(it->second.chain.holder);  // never claimed (or a sender that vanished)
      it = m->erase(it);
    }
}

infer::RequestId Server::Impl::admit_resumed(Job& job, size_t prompt) {
  infer::RequestOutput primed;
  const auto id = engine_.add_resumed_request(job.req.prompts[prompt], job.resume, job.req.params, job.req.adapter,
                                              &primed);
  if (job.emit_resumed) {
    primed.id = id;
    job.output_tokens += static_cast<int64_t>(primed.new_tokens.size());
    job.push({0, std::move(primed)});
  }
  return id;
}

void Server::Impl::disagg_job_done(Job& job) {
  std::lock_guard<std::mutex> lock(job.m);
  if (job.error || job.req.prompts.size() != 1) return;
  job.kv_chain = engine_.hold_kv_prefix(job.req.prompts[0], job.req.adapter);
}

void Server::Impl::disagg_job_started(Job& job) {
  if (!disagg_) return;
  auto it = disagg_->holds.find(job.transfer_id);
  if (it == disagg_->holds.end()) return;
  engine_.release_kv(it->second.chain.holder);  // the request holds its blocks itself now
  disagg_->holds.erase(it);
}

void Server::Impl::start_disagg() {
  if (config_.role.empty()) return;
  TESSERA_CHECK(engine_.config().prefix_caching, "--role ", config_.role,
                " needs prefix caching (KV blocks move as prefix-cache blocks); drop --no-prefix-caching");
  disagg_ = std::make_shared<Disagg>(*this);
  if (config_.role != "decode") return;
  if (config_.kv_transport == "shm") {
    const std::string name = "/tessera-kv-" + std::to_string(::getpid()) + "-" + std::to_string(port_.load());
    disagg_->shm = std::make_unique<infer::KvShmLayout>(infer::place_pool_in_shm(engine_.kv_pool(), name));
  }
  disagg_->receiver = std::make_unique<KvReceiver>(config_.host, config_.kv_port, *disagg_, disagg_->shm.get(),
                                                   engine_.config().block_size);
  std::fprintf(stderr, "tessera serve: decode worker: KV receiver on %s:%d (transports: tcp%s)\n",
               config_.host.c_str(), disagg_->receiver->port(), disagg_->shm ? ", shm" : "");
  if (disagg_->shm) std::fprintf(stderr, "tessera serve: KV pool in shared memory %s\n", disagg_->shm->name.c_str());
}

void Server::Impl::stop_disagg() {
  if (disagg_ && disagg_->receiver) disagg_->receiver->stop();
}

std::string Server::Impl::disagg_metrics() const {
  if (!disagg_) return "";
  const std::string l = "model_name=\"" + config_.model_name + "\",role=\"" + config_.role + "\"";
  auto& d = *disagg_;
  const char* what = config_.role == "prefill" ? "sent to decode workers" : "received from prefill workers";
  std::string o = d.seconds.render("tessera_kv_transfer_seconds",
                                   std::string("KV transfers ") + what + ": hello to ack", l);
  auto counter = [&](const char* name, const std::string& help, int64_t v) {
    o += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " counter\n" + name + "{" + l + "} " +
         std::to_string(v) + "\n";
  };
  counter("tessera_kv_transfer_bytes_total", std::string("KV block bytes ") + what, d.bytes.load());
  counter("tessera_kv_transfer_blocks_total", std::string("KV blocks ") + what, d.blocks.load());
  counter("tessera_kv_transfers_total", "KV transfers completed", d.transfers.load());
  counter("tessera_kv_transfer_failures_total", "KV transfers that failed", d.failures.load());
  return o;
}

// ---- routes ---------------------------------------------------------------------------------

void Server::Impl::handle_kv_prefill(const httplib::Request& req, httplib::Response& res) {
  if (config_.role != "prefill") bad_request("", "this worker was not started with --role prefill");
  const json b = parse_body(req.body);
  ApiRequest r = parse_worker_request(b, info_);
  const int64_t client_max = r.params.max_tokens;
  r.params.max_tokens = 1;
  r.stream = false;
  KvTarget target;
  const json& d = b.at("decode");
  target.host = d.at("host").get<std::string>();
  target.port = d.at("port").get<int>();
  target.transport = d.value("transport", std::string("tcp"));
  target.worker = d.value("worker", target.host + ":" + std::to_string(target.port));
  const int64_t transfer_id = b.at("transfer_id").get<int64_t>();
  auto job = submit(std::move(r), [](Job& j) { j.kv_export = true; });
  struct State {
    int stage = 0;
    bool finished = false;  // the request ended at its first token: nothing to transfer
    std::unique_ptr<KvSendSession> session;  // opened while the prompt runs
    std::string open_error, open_kind;
  };
  auto st = std::make_shared<State>();
  auto release_hold = [this, job] {
    std::optional<infer::Engine::KvChain> chain;
    {
      std::lock_guard<std::mutex> lock(job->m);
      chain.swap(job->kv_chain);
    }
    if (chain) post_engine_task([this, holder = chain->holder] { engine_.release_kv(holder); });
  };
  res.set_header("Cache-Control", "no-cache");
  res.set_chunked_content_provider(
      "text/event-stream",
      [this, job, st, client_max, target, transfer_id, release_hold](size_t, httplib::DataSink& sink) {
        if (st->stage == 0) {
          // The handshake (the decode worker reserves blocks between its steps) overlaps the
          // prefill: the prompt's chain hashes are known before its K/V is.
          const auto& prompt = job->req.prompts[0];
          try {
            st->session = std::make_unique<KvSendSession>(
                target, engine_.kv_pool(), transfer_id, job->req.adapter, prompt,
                chain_hashes(prompt, engine_.kv_pool().block_size, job->req.adapter));
          } catch (const KvTransferError& ex) {
            st->open_error = ex.what();
            st->open_kind = ex.kind;
          } catch (const std::exception& ex) {
            st->open_error = std::string("KV transfer to ") + target.worker + ": " + ex.what();
            st->open_kind = "protocol";
          }
          std::deque<Event> events;
          std::unique_ptr<ApiError> error;
          {
            std::unique_lock<std::mutex> lock(job->m);
            job->cv.wait(lock, [&] { return job->done; });
            events.swap(job->events);
            error = std::move(job->error);
          }
          json first;
          if (error) {
            first = error_body(error->what(), error->type, error->param, error->code);
            first["status"] = error->status;
            st->finished = true;
          } else {
            std::vector<std::string> chunks;
            std::string usage_chunk;
            json full;
            render_events(*job, events, chunks, usage_chunk, full);
            int64_t token = -1, cached = 0;
            std::string reason = "length";
            for (const auto& e : events) {
              if (!e.out.new_tokens.empty()) token = e.out.new_tokens[0];
              if (e.out.finished) reason = e.out.finish_reason;
              cached = std::max(cached, e.out.num_cached_tokens);
            }
            st->finished = token < 0 || reason != "length" || client_max <= 1;
            json cj = json::array();
            for (const auto& c : chunks) cj.push_back(json::parse(c));
            first = {{"token", token < 0 ? json(nullptr) : json(token)},
                     {"finish_reason", reason},
                     {"finished", st->finished},
                     {"chunks", cj},
                     {"usage_chunk", usage_chunk.empty() ? json(nullptr) : json::parse(usage_chunk)},
                     {"full", full},
                     {"cached_tokens", cached},
                     {"prompt_token_ids", job->req.prompts[0]}};
          }
          const std::string out = "data: " + dump(first) + "\n\n";
          st->stage = 1;
          if (!sink.write(out.data(), out.size())) return false;
          if (!st->finished) return true;
          st->session.reset();  // cancels the reservation
          sink.done();
          return true;
        }
        // stage 1: the KV blocks to the decode worker, then the outcome
        std::vector<BlockId> blocks;
        {
          std::lock_guard<std::mutex> lock(job->m);
          if (job->kv_chain) blocks = job->kv_chain->blocks;
        }
        json kv;
        try {
          if (!st->session) throw KvTransferError(st->open_kind, st->open_error);
          const KvSendResult r = st->session->send(blocks);
          kv = {{"ok", true},
                {"blocks", r.blocks},
                {"bytes", r.bytes},
                {"seconds", r.seconds},
                {"handshake_seconds", st->session->handshake_seconds()},
                {"remote_cached", r.remote_cached},
                {"transport", r.transport},
                {"prompt_blocks", blocks.size()}};
          disagg_->bytes += r.bytes;
          disagg_->blocks += r.blocks;
          ++disagg_->transfers;
          disagg_->seconds.observe(r.seconds);
        } catch (const KvTransferError& ex) {
          ++disagg_->failures;
          kv = {{"ok", false}, {"kind", ex.kind}, {"error", ex.what()}};
        } catch (const std::exception& ex) {
          ++disagg_->failures;
          kv = {{"ok", false}, {"kind", "protocol"}, {"error", std::string("KV transfer to ") + target.worker + ": " + ex.what()}};
        }
        release_hold();
        const std::string out = "data: " + dump({{"kv", kv}}) + "\n\n";
        if (!sink.write(out.data(), out.size())) return false;
        sink.done();
        return true;
      },
      [this, job, release_hold](bool) {
        release_hold();
        release(job, false);
      });
}

void Server::Impl::handle_kv_decode(const httplib::Request& req, httplib::Response& res) {
  if (config_.role != "decode") bad_request("", "this worker was not started with --role decode");
  const json b = parse_body(req.body);
  ApiRequest r = parse_worker_request(b, info_);
  if (r.params.logprobs) bad_request("logprobs", "logprobs are not supported with disaggregated serving yet");
  r.prompts[0] = token_list(b, "prompt_token_ids", info_.vocab_size);
  std::vector<int32_t> generated = token_list(b, "generated", info_.vocab_size);
  if (generated.empty()) bad_request("generated", "generated must hold the prefill worker's first token");
  const bool emit = b.value("emit_generated", false);
  const int64_t transfer_id = b.value("transfer_id", int64_t{-1});
  auto job = submit(std::move(r), [&](Job& j) {
    j.resume = generated;
    j.emit_resumed = emit;
    j.transfer_id = transfer_id;
  });
  if (job->req.stream) {
    stream_response(job, res);
  } else {
    full_response(job, res);
  }
}

void Server::Impl::setup_disagg_routes() {
  http_.Post("/kv/prefill", [this](const httplib::Request& req, httplib::Response& res) {
    guard(res, [&] { handle_kv_prefill(req, res); });
  });
  http_.Post("/kv/decode", [this](const httplib::Request& req, httplib::Response& res) {
    guard(res, [&] { handle_kv_decode(req, res); });
  });
  http_.Get("/kv/info", [this](const httplib::Request&, httplib::Response& res) {
    const auto& pool = engine_.kv_pool();
    json info = {{"role", config_.role.empty() ? "colocated" : config_.role},
                 {"model", config_.model_name},
                 {"block_size", pool.block_size},
                 {"block_bytes", pool.block_bytes()},
                 {"num_blocks", pool.num_blocks},
                 {"kv_cache_dtype", kernels::kv_cache_dtype_name(pool.dtype)}};
    if (disagg_ && disagg_->receiver) {
      info["kv_port"] = disagg_->receiver->port();
      info["transports"] = disagg_->shm ? json::array({"tcp", "shm"}) : json::array({"tcp"});
      if (disagg_->shm) info["shm"] = disagg_->shm->name;
    }
    res.set_content(dump(info), "application/json");
  });
}

}  // namespace tessera::serve
