// The server's HTTP routes: OpenAI completions and chat (full and SSE streaming), models,
// health, metrics, stats, tokenize / detokenize, the chat page; auth and error bodies.
#include <cstdio>

#include "tessera/base/logging.h"
#include "tessera/base/memory.h"
#include "tessera/serve/chat_page.h"
#include "tessera/serve/http_reply.h"
#include "tessera/serve/openai_echo.h"
#include "tessera/serve/server_impl.h"

namespace tessera::serve {
namespace {

using nlohmann::json;

json body_json(const httplib::Request& req) { return parse_body(req.body); }

// The "data:" payloads of SSE text this file wrote.
std::vector<std::string> sse_payloads(const std::string& sse) {
  std::vector<std::string> out;
  size_t pos = 0;
  while ((pos = sse.find("data: ", pos)) != std::string::npos) {
    const size_t end = sse.find("\n\n", pos);
    out.push_back(sse.substr(pos + 6, end - pos - 6));
    pos = end;
  }
  return out;
}

// Builds OpenAI responses and stream chunks from a job's events.
class Accumulator {
 public:
  Accumulator(const Job& job, const io::Tokenizer* tok)
      : job_(job), tok_(tok), choices_(job.req.choices()), cached_(job.req.prompts.size(), 0) {}

  // Folds an event into the totals.
  void add(const Event& e) {
    Choice& c = choices_[e.choice];
    c.text += e.out.new_text;
    c.tokens = e.out.num_output_tokens;
    if (!e.out.logprobs.empty()) c.lps.insert(c.lps.end(), e.out.logprobs.begin(), e.out.logprobs.end());
    if (!e.out.prompt_logprobs.empty()) c.prompt_lps = e.out.prompt_logprobs;
    if (e.out.finished) c.finish = e.out.finish_reason;
    const size_t p = static_cast<size_t>(e.choice / job_.req.params.n);
    cached_[p] = std::max(cached_[p], e.out.num_cached_tokens);
  }

  json usage() const {
    int64_t prompt = 0, completion = 0, cached = 0;
    for (const auto& p : job_.req.prompts) prompt += static_cast<int64_t>(p.size());
    for (const auto& c : choices_) completion += job_.req.echo_only ? 0 : c.tokens;
    for (int64_t c : cached_) cached += c;
    return usage_json(prompt, completion, cached);
  }

  json header(const char* object) const {
    return {{"id", job_.id}, {"object", object}, {"created", job_.created}, {"model", job_.req.model}};
  }

  // The whole response once every choice finished.
  json full() const {
    const bool chat = job_.req.endpoint == Endpoint::kChat;
    json out = header(chat ? "chat.completion" : "text_completion");
    json list = json::array();
    for (size_t i = 0; i < choices_.size(); ++i) {
      const Choice& c = choices_[i];
      json ch = {{"index", i}, {"finish_reason", c.finish.empty() ? json(nullptr) : json(c.finish)}};
      if (chat && job_.req.tools.active()) {  // tool calls read out of the text (tool_calls.h)
        const ParsedToolOutput p = parse_tool_output(job_.req.tools, c.text);
        ch["message"] = {{"role", "assistant"}, {"content", p.content ? json(*p.content) : json(nullptr)}};
        if (!p.calls.empty()) ch["message"]["tool_calls"] = tool_calls_json(p.calls);
        if (!c.finish.empty()) ch["finish_reason"] = tool_finish_reason(job_.req.tools, !p.calls.empty(), c.finish);
      } else if (chat) {
        ch["message"] = {{"role", "assistant"}, {"content", c.text}};
      }
      if (chat) {
        ch["logprobs"] = job_.req.chat_logprobs ? chat_logprobs(c.lps, tok_) : json(nullptr);
      } else {
        completion_fields(ch, i, c);
      }
      list.push_back(std::move(ch));
    }
    out["choices"] = std::move(list);
    if (chat && job_.req.prompt_logprobs)  // vLLM: chat's prompt_logprobs are the response's
      out["prompt_logprobs"] = prompt_logprobs_json(job_.req.prompts[0], choices_[0].prompt_lps, tok_);
    out["usage"] = usage();
    return out;
  }

  // SSE "data:" payloads for one event (chat sends the assistant role first).
  void stream_chunks(const Event& e, std::string& out) {
    const bool chat = job_.req.endpoint == Endpoint::kChat;
    Choice& c = choices_[e.choice];
    const size_t prompt = static_cast<size_t>(e.choice / job_.req.params.n);
    const std::string& echo = job_.req.echo ? job_.req.echo_texts[prompt] : kNoText;
    const int64_t offset = static_cast<int64_t>(echo.size() + c.text.size());
    add(e);
    json fr = e.out.finished ? json(c.finish) : json(nullptr);
    if (chat) {
      if (!c.role_sent) {
        c.role_sent = true;
        json first = header("chat.completion.chunk");
        first["choices"] = json::array({{{"index", e.choice},
                                         {"delta", {{"role", "assistant"}, {"content", ""}}},
                                         {"logprobs", nullptr},
                                         {"finish_reason", nullptr}}});
        if (job_.req.prompt_logprobs && e.choice == 0)
          first["prompt_logprobs"] = prompt_logprobs_json(job_.req.prompts[0], c.prompt_lps, tok_);
        append(first, out);
      }
      if (e.out.new_text.empty() && !e.out.finished && e.out.logprobs.empty()) return;
      json chunk = header("chat.completion.chunk");
      json delta = json::object();
      if (job_.req.tools.active()) {  // text that may start a call is held back (tool_calls.h)
        if (!c.tools) c.tools = std::make_shared<ToolStreamParser>(job_.req.tools);
        ToolStreamParser::Delta d = c.tools->feed(e.out.new_text);
        if (e.out.finished) {
          ToolStreamParser::Delta last = c.tools->finish();
          d.content += last.content;
          for (auto& t : last.tool_calls) d.tool_calls.push_back(std::move(t));
          fr = tool_finish_reason(job_.req.tools, c.tools->calls() > 0, c.finish);
        }
        if (!d.content.empty()) delta["content"] = d.content;
        if (!d.tool_calls.empty()) delta["tool_calls"] = std::move(d.tool_calls);
      } else if (!e.out.new_text.empty()) {
        delta["content"] = e.out.new_text;
      }
      json ch = {{"index", e.choice}, {"delta", delta}, {"finish_reason", fr}};
      ch["logprobs"] = job_.req.chat_logprobs && !e.out.logprobs.empty() ? chat_logprobs(e.out.logprobs, tok_)
                                                                        : json(nullptr);
      if (job_.req.return_token_ids) ch["token_ids"] = e.out.new_tokens;
      chunk["choices"] = json::array({ch});
      append(chunk, out);
    } else {
      if (!c.prompt_sent && (job_.req.echo || job_.req.prompt_logprobs)) {
        // The prompt first: its text (echo), its tokens' logprobs, vLLM's prompt_logprobs.
        c.prompt_sent = true;
        const auto& ids = job_.req.prompts[prompt];
        json first = header("text_completion");
        json ch = {{"index", e.choice}, {"text", echo}, {"finish_reason", nullptr}};
        ch["logprobs"] = job_.req.params.logprobs && job_.req.echo ? echo_prompt_logprobs(ids, c.prompt_lps, tok_)
                                                                   : json(nullptr);
        if (job_.req.return_token_ids) ch["token_ids"] = job_.req.echo ? ids : std::vector<int32_t>{};
        if (job_.req.prompt_logprobs) ch["prompt_logprobs"] = prompt_logprobs_json(ids, c.prompt_lps, tok_);
        first["choices"] = json::array({ch});
        append(first, out);
      }
      if (job_.req.echo_only) {  // the prompt was all: only the end of the choice follows
        if (!e.out.finished) return;
        json last = header("text_completion");
        last["choices"] = json::array({{{"index", e.choice}, {"text", ""}, {"logprobs", nullptr},
                                        {"finish_reason", "length"}}});
        append(last, out);
        return;
      }
      json chunk = header("text_completion");
      json ch = {{"index", e.choice}, {"text", e.out.new_text}, {"finish_reason", fr}};
      ch["logprobs"] = job_.req.params.logprobs && !e.out.logprobs.empty()
                           ? completion_logprobs(e.out.logprobs, tok_, offset)
                           : json(nullptr);
      if (job_.req.return_token_ids) ch["token_ids"] = e.out.new_tokens;
      chunk["choices"] = json::array({ch});
      append(chunk, out);
    }
  }

  void usage_chunk(std::string& out) const {
    json chunk = header(job_.req.endpoint == Endpoint::kChat ? "chat.completion.chunk" : "text_completion");
    chunk["choices"] = json::array();
    chunk["usage"] = usage();
    out += "data: " + dump(chunk) + "\n\n";
  }

 private:
  struct Choice {
    std::string text, finish;
    int64_t tokens = 0;
    std::vector<infer::SampleResult> lps;
    std::vector<infer::PromptLogprob> prompt_lps;
    bool role_sent = false;
    bool prompt_sent = false;  // completions stream: the echo / prompt_logprobs chunk went out
    std::shared_ptr<ToolStreamParser> tools;  // streaming with tools: the output's tool-call reader
  };
  inline static const std::string kNoText;

  // A completions choice's text and logprobs; with echo the prompt comes first in both.
  void completion_fields(json& ch, size_t i, const Choice& c) const {
    const size_t p = i / static_cast<size_t>(job_.req.params.n);
    const auto& ids = job_.req.prompts[p];
    const std::string& echo = job_.req.echo ? job_.req.echo_texts[p] : kNoText;
    const bool only = job_.req.echo_only;  // max_tokens 0: the engine's one token is left out
    ch["text"] = only ? echo : echo + c.text;
    if (only) ch["finish_reason"] = "length";
    if (!job_.req.params.logprobs) {
      ch["logprobs"] = nullptr;
    } else if (job_.req.echo) {
      json lp = echo_prompt_logprobs(ids, c.prompt_lps, tok_);
      if (!only)
        append_completion_logprobs(lp, completion_logprobs(c.lps, tok_, static_cast<int64_t>(echo.size())));
      ch["logprobs"] = std::move(lp);
    } else {
      ch["logprobs"] = completion_logprobs(c.lps, tok_, 0);
    }
    if (job_.req.prompt_logprobs) ch["prompt_logprobs"] = prompt_logprobs_json(ids, c.prompt_lps, tok_);
  }
  void append(json& chunk, std::string& out) const {
    if (job_.req.include_usage) chunk["usage"] = job_.req.continuous_usage ? usage() : json(nullptr);
    out += "data: " + dump(chunk) + "\n\n";
  }

  const Job& job_;
  const io::Tokenizer* tok_;
  std::vector<Choice> choices_;
  std::vector<int64_t> cached_;  // per prompt
};

}  // namespace

void Server::Impl::render_events(const Job& job, const std::deque<Event>& events, std::vector<std::string>& chunks,
                                 std::string& usage_chunk, json& full) {
  Accumulator stream(job, tokenizer_), whole(job, tokenizer_);
  std::string out;
  for (const auto& e : events) {
    stream.stream_chunks(e, out);
    whole.add(e);
  }
  for (const auto& d : sse_payloads(out)) chunks.push_back(d);
  std::string u;
  if (job.req.include_usage) stream.usage_chunk(u);
  usage_chunk = u.empty() ? "" : sse_payloads(u).at(0);
  full = whole.full();
}

void Server::Impl::handle_generate(const httplib::Request& req, httplib::Response& res, Endpoint endpoint) {
  ApiRequest r = parse_request(body_json(req), endpoint, info_, req.body);
  auto job = submit(std::move(r));
  if (config_.log_requests)
    std::fprintf(stderr, "tessera serve: %s %s: %zu prompt(s), max_tokens %lld, stream %d\n", job->id.c_str(),
                 req.path.c_str(), job->req.prompts.size(), static_cast<long long>(job->req.params.max_tokens),
                 job->req.stream ? 1 : 0);
  if (job->req.stream) {
    stream_response(job, res);
  } else {
    full_response(job, res);
  }
}

void Server::Impl::full_response(const std::shared_ptr<Job>& job, httplib::Response& res) {
  Accumulator acc(*job, tokenizer_);
  std::unique_ptr<ApiError> error;
  {
    std::unique_lock<std::mutex> lock(job->m);
    job->cv.wait(lock, [&] { return job->done; });  // the engine thread enforces timeouts
    for (const auto& e : job->events) acc.add(e);
    job->events.clear();
    error = std::move(job->error);
  }
  release(job, false);
  if (error) {
    send_error(res, *error);
    return;
  }
  send_json(res, 200, acc.full());
}

void Server::Impl::stream_response(const std::shared_ptr<Job>& job, httplib::Response& res) {
  struct State {
    Accumulator acc;
    bool finished = false;
    Clock::time_point last_write = Clock::now();
  };
  auto st = std::make_shared<State>(State{Accumulator(*job, tokenizer_)});
  res.set_header("Cache-Control", "no-cache");
  res.set_header("X-Accel-Buffering", "no");
  res.set_chunked_content_provider(
      "text/event-stream",
      [this, job, st](size_t, httplib::DataSink& sink) {
        std::deque<Event> events;
        bool done = false;
        std::unique_ptr<ApiError> error;
        {
          std::unique_lock<std::mutex> lock(job->m);
          job->cv.wait_for(lock, std::chrono::milliseconds(250),
                           [&] { return !job->events.empty() || job->done; });
          events.swap(job->events);
          done = job->done;
          if (done) error = std::move(job->error);
        }
        std::string out;
        for (const auto& e : events) st->acc.stream_chunks(e, out);
        if (done) {
          if (error) {
            out += "data: " + dump(error_body(error->what(), error->type, error->param, error->code)) + "\n\n";
          } else if (job->req.include_usage) {
            st->acc.usage_chunk(out);
          }
          out += "data: [DONE]\n\n";
        }
        const auto now = Clock::now();
        // A comment now and then: writing is how a vanished client is noticed while queued.
        if (out.empty() && now - st->last_write > std::chrono::milliseconds(500)) out = ": keep-alive\n\n";
        if (!out.empty()) {
          if (!sink.write(out.data(), out.size())) return false;
          st->last_write = now;
        }
        if (done) {
          st->finished = true;
          sink.done();
        }
        return true;
      },
      [this, job, st](bool) { release(job, !st->finished); });
}

void Server::Impl::setup_routes() {
  auto guarded = [this](auto&& fn) {
    return [this, fn](const httplib::Request& req, httplib::Response& res) {
      struct MarkDone {  // on every exit, exceptions included
        std::atomic<int64_t>& at;
        ~MarkDone() { at.store(now_ns(), std::memory_order_relaxed); }
      } mark{http_done_ns_};
      try {
        fn(req, res);
      } catch (...) {
        const ApiError e = api_error_of(std::current_exception());
        if (e.status == 500) TESSERA_LOG(kError, "serve: ", req.method, " ", req.path, ": ", e.what());
        send_error(res, e);
      }
    };
  };

  http_.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (config_.api_key.empty() || req.path.rfind("/v1/", 0) != 0) return httplib::Server::HandlerResponse::Unhandled;
    const std::string auth = req.get_header_value("Authorization");
    if (auth == "Bearer " + config_.api_key) return httplib::Server::HandlerResponse::Unhandled;
    send_json(res, 401,
              error_body(auth.empty() ? "missing API key: send 'Authorization: Bearer KEY'" : "incorrect API key provided",
                         "invalid_request_error", "", "invalid_api_key"));
    return httplib::Server::HandlerResponse::Handled;
  });
  http_.set_error_handler([](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;
    std::string msg = "HTTP " + std::to_string(res.status);
    if (res.status == 404) msg = "no route for " + req.method + " " + req.path;
    if (res.status == 413) msg = "the request body is larger than the server's limit";
    if (res.status == 400) msg = "malformed HTTP request";
    send_json(res, res.status, error_body(msg, "invalid_request_error", "", ""));
  });
  http_.set_exception_handler([](const httplib::Request& req, httplib::Response& res, std::exception_ptr ep) {
    std::string what = "unknown";
    try {
      std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    TESSERA_LOG(kError, "serve: ", req.method, " ", req.path, ": ", what);
    send_json(res, 500, error_body("internal error: " + what, "internal_error", "", ""));
  });
  http_.set_logger([this](const httplib::Request& req, const httplib::Response& res) {
    metrics_.http_response(res.status);
    if (config_.log_requests)
      std::fprintf(stderr, "tessera serve: %s %s -> %d\n", req.method.c_str(), req.path.c_str(), res.status);
  });

  http_.Post("/v1/completions", guarded([this](const httplib::Request& req, httplib::Response& res) {
               handle_generate(req, res, Endpoint::kCompletions);
             }));
  http_.Post("/v1/chat/completions", guarded([this](const httplib::Request& req, httplib::Response& res) {
               handle_generate(req, res, Endpoint::kChat);
             }));
  setup_api_routes([&](Handler h) -> Handler { return guarded(std::move(h)); });
  http_.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    if (healthy()) {
      res.set_content("ok\n", "text/plain");
    } else {
      send_json(res, 503, error_body("the engine loop is not stepping", "service_unavailable", "", "engine_stalled"));
    }
  });
  http_.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics_.render() + disagg_metrics(), "text/plain; version=0.0.4; charset=utf-8");
  });
  http_.Get("/stats", [this](const httplib::Request&, httplib::Response& res) {
    Snapshot s;
    {
      std::lock_guard<std::mutex> lock(snap_m_);
      s = snapshot_;
    }
    send_json(res, 200,
              {{"model", info_.name},
               {"running", s.running},
               {"waiting", s.waiting},
               {"kv_blocks_used", s.kv_blocks_used},
               {"kv_blocks_total", s.kv_blocks_total},
               {"kv_usage", s.kv_blocks_total > 0 ? static_cast<double>(s.kv_blocks_used) / s.kv_blocks_total : 0.0},
               {"prompt_tokens_total", s.prompt_tokens},
               {"generation_tokens_total", s.generation_tokens},
               {"generation_tokens_per_s", s.tokens_per_s},
               {"requests_total", next_job_.load() - 1},
               {"in_flight", in_flight_.load()},
               {"engine_steps", s.steps},
               {"heap_bytes_in_use", base::heap_bytes_in_use()},
               {"uptime_s", std::chrono::duration<double>(Clock::now() - started_).count()}});
  });
  http_.Post("/tokenize", guarded([this](const httplib::Request& req, httplib::Response& res) {
               const json b = body_json(req);
               if (!b.is_object()) bad_request("", "the request body must be a JSON object");
               if (!tokenizer_) bad_request("", "the served model has no tokenizer");
               std::vector<int32_t> ids;
               if (b.contains("messages")) {
                 json probe = b;
                 probe.erase("prompt");
                 probe["max_tokens"] = 1;
                 const ApiRequest r = parse_request(probe, Endpoint::kChat, info_, req.body);
                 ids = r.prompts.at(0);
               } else {
                 auto it = b.find("prompt");
                 if (it == b.end() || !it->is_string()) bad_request("prompt", "prompt must be a string (or give messages)");
                 bool special = true;
                 if (auto s = b.find("add_special_tokens"); s != b.end() && !s->is_null()) {
                   if (!s->is_boolean()) bad_request("add_special_tokens", "add_special_tokens must be true or false");
                   special = s->get<bool>();
                 }
                 ids = tokenizer_->encode(it->get<std::string>(), special);
               }
               send_json(res, 200,
                         {{"tokens", ids}, {"count", ids.size()}, {"max_model_len", info_.max_model_len}});
             }));
  http_.Post("/detokenize", guarded([this](const httplib::Request& req, httplib::Response& res) {
               const json b = body_json(req);
               if (!b.is_object()) bad_request("", "the request body must be a JSON object");
               if (!tokenizer_) bad_request("", "the served model has no tokenizer");
               auto it = b.find("tokens");
               if (it == b.end() || !it->is_array()) bad_request("tokens", "tokens must be a list of token ids");
               std::vector<int32_t> ids;
               for (const auto& t : *it) {
                 if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() >= tokenizer_->vocab_size())
                   bad_request("tokens", "tokens must be token ids in [0, " + std::to_string(tokenizer_->vocab_size()) + ")");
                 ids.push_back(t.get<int32_t>());
               }
               std::string text;
               try {
                 text = tokenizer_->decode(ids);
               } catch (const Error& e) {
                 bad_request("tokens", e.what());
               }
               send_json(res, 200, {{"prompt", text}});
             }));
  setup_disagg_routes();
  http_.Get("/", [](const httplib::Request&, httplib::Response& res) {
    res.set_content(chat_page_html(), "text/html; charset=utf-8");
  });
}

}  // namespace tessera::serve
