// `tessera router` (router.h): routing by load and prefix affinity, and the request path:
// prefill call (first token streamed at once, KV transfer reported), then the decode call whose
// stream is relayed with the router's ids. The server and health checks: router_server.cc.
#include "tessera/serve/router_impl.h"

namespace tessera::serve {

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
    if (status != 0 && status != 200) {  // the worker answered: a request error passes on as is
      answer_error(res, *p, status, call->error_body);
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
      answer_error(*res, d, r->status, r->body);
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
    httplib::Response tmp;
    answer_error(tmp, d, status, error_text);
    const std::string out = "data: " + tmp.body + "\n\n";
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

}  // namespace tessera::serve
