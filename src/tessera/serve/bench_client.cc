// The HTTP load generator: one worker thread per request slot, each with its own keep-alive
// httplib::Client, streaming POST /v1/completions and timing the SSE chunks as they arrive.
#include "tessera/serve/bench_client.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdarg>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <regex>
#include <thread>

#include <httplib.h>
#include <nlohmann/json.hpp>

#include "tessera/base/error.h"
#include "tessera/base/strings.h"
#include "tessera/base/timer.h"
#include "tessera/io/json_file.h"
#include "tessera/io/tokenizer.h"
#include "tessera/serve/bench_prompts.h"

namespace tessera::serve {
namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

constexpr size_t kMaxFailuresShown = 5;
constexpr size_t kMaxErrorBody = 300;  // bytes of an error response quoted in a failure

double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Where the server is: "http://host:port" for httplib::Client, and the path prefix.
struct Target {
  std::string origin, prefix;
  httplib::Headers headers;
};

Target parse_target(const std::string& url, const std::string& api_key) {
  static const std::regex re(R"(^(https?://[^/?#]+)(/[^?#]*)?$)", std::regex::icase);
  std::smatch m;
  TESSERA_CHECK(std::regex_match(url, m, re), "--url '", url, "' is not http://HOST:PORT[/PATH]");
  Target t;
  t.origin = m[1].str();
  t.prefix = m[2].str();
  while (!t.prefix.empty() && t.prefix.back() == '/') t.prefix.pop_back();
  if (t.prefix.size() >= 3 && t.prefix.compare(t.prefix.size() - 3, 3, "/v1") == 0)
    t.prefix.resize(t.prefix.size() - 3);  // routes are added below
  t.headers.emplace("User-Agent", "tessera-bench");
  if (!api_key.empty()) t.headers.emplace("Authorization", "Bearer " + api_key);
  return t;
}

std::unique_ptr<httplib::Client> make_client(const Target& t, double timeout_s) {
  auto c = std::make_unique<httplib::Client>(t.origin);
  TESSERA_CHECK(c->is_valid(), "--url: cannot make a client for '", t.origin, "'");
  const auto timeout = std::chrono::duration<double>(timeout_s);
  c->set_connection_timeout(std::chrono::duration_cast<std::chrono::microseconds>(
      std::min(timeout, std::chrono::duration<double>(30))));
  c->set_read_timeout(std::chrono::duration_cast<std::chrono::microseconds>(timeout));
  c->set_write_timeout(std::chrono::duration_cast<std::chrono::microseconds>(timeout));
  c->set_keep_alive(true);
  c->set_tcp_nodelay(true);
  return c;
}

std::string truncated(std::string s) {
  if (s.size() > kMaxErrorBody) s = s.substr(0, kMaxErrorBody) + "...";
  std::replace(s.begin(), s.end(), '\n', ' ');
  return s;
}

// The served model and what the prompts need from it, from whichever fields the server has.
struct ModelInfo {
  std::string id;
  int64_t vocab_size = 0;  // 0: not reported
  std::string vocab_from;
  int64_t max_model_len = std::numeric_limits<int64_t>::max();
  std::string max_model_len_from;
};

// m[key], or m["meta"][key] (llama-server), when it is a positive integer.
bool read_count(const json& m, const char* key, const char* meta_key, int64_t* out, std::string* from) {
  if (m.contains(key) && m[key].is_number_integer() && m[key].get<int64_t>() > 0) {
    *out = m[key].get<int64_t>();
    *from = key;
    return true;
  }
  if (m.contains("meta") && m["meta"].is_object()) {
    const json& meta = m["meta"];
    if (meta.contains(meta_key) && meta[meta_key].is_number_integer() && meta[meta_key].get<int64_t>() > 0) {
      *out = meta[meta_key].get<int64_t>();
      *from = std::string("meta.") + meta_key;
      return true;
    }
  }
  return false;
}

ModelInfo fetch_model(const Target& t, const std::string& url, const std::string& wanted, double timeout_s) {
  auto cli = make_client(t, std::min(timeout_s, 30.0));
  const std::string where = url + " (GET " + t.prefix + "/v1/models)";
  auto res = cli->Get(t.prefix + "/v1/models", t.headers);
  TESSERA_CHECK(res, "bench serve: cannot reach ", where, ": ", httplib::to_string(res.error()));
  TESSERA_CHECK(res->status == 200, "bench serve: ", where, " returned HTTP ", res->status, ": ",
                truncated(res->body));
  json j;
  try {
    j = io::parse_json_text(res->body, "bench serve: " + where);  // bounded: the server is not ours
  } catch (const Error& e) {
    fail(e.what());
  }
  TESSERA_CHECK(j.is_object() && j.contains("data") && j["data"].is_array() && !j["data"].empty(),
                "bench serve: ", where, " lists no models: ", truncated(res->body));
  std::vector<std::string> ids;
  for (const json& m : j["data"]) {
    TESSERA_CHECK(m.is_object() && m.contains("id") && m["id"].is_string(), "bench serve: ", where,
                  " has an entry without a string \"id\"");
    ids.push_back(m["id"].get<std::string>());
    if (!wanted.empty() && ids.back() != wanted) continue;
    ModelInfo info;
    info.id = ids.back();
    read_count(m, "vocab_size", "n_vocab", &info.vocab_size, &info.vocab_from);
    read_count(m, "max_model_len", "n_ctx_train", &info.max_model_len, &info.max_model_len_from);
    return info;
  }
  std::string served;
  for (const auto& id : ids) served += (served.empty() ? "" : ", ") + id;
  fail("bench serve: --model '", wanted, "' is not served by ", url, " (it serves: ", served, ")");
}

// Sends one streaming completion and times its chunks. Never throws for server or transport
// trouble: that becomes rec.error.
HttpRequestRecord send_request(httplib::Client& cli, const Target& t, const std::string& model,
                               const HttpPrompt& req, double timeout_s, Clock::time_point bench_start) {
  HttpRequestRecord rec;
  rec.prompt_tokens = req.tokens;
  rec.max_tokens = req.max_tokens;
  const json body{{"model", model},
                  {"prompt", req.as_text ? json(req.text) : json(req.ids)},
                  {"max_tokens", req.max_tokens},
                  {"temperature", 0},
                  {"stream", true},
                  {"stream_options", {{"include_usage", true}}},
                  {"ignore_eos", true}};
  httplib::Request hr;
  hr.method = "POST";
  hr.path = t.prefix + "/v1/completions";
  hr.headers = t.headers;
  hr.set_header("Content-Type", "application/json");
  hr.set_header("Accept", "text/event-stream");
  hr.set_header("Accept-Encoding", "identity");
  hr.body = body.dump();

  int status = 0;
  std::string error_body, stream_error;
  SseParser sse;
  bool done = false, got_first = false, timed_out = false;
  int64_t usage_tokens = -1, usage_prompt = -1, id_tokens = 0, token_chunks = 0;
  Clock::time_point start, last, end;
  Clock::time_point now;  // when the bytes being parsed arrived
  const auto on_event = [&](const std::string& data) {
    if (done || !stream_error.empty()) return;
    if (data == "[DONE]") {
      done = true;
      end = now;
      return;
    }
    json j;
    try {
      j = io::parse_json_text(data, "chunk");
    } catch (const Error&) {
      stream_error = "a chunk is not JSON: " + truncated(data);
      return;
    }
    if (!j.is_object()) {
      stream_error = "a chunk is not a JSON object: " + truncated(data);
      return;
    }
    if (j.contains("error")) {
      stream_error = "error in the stream: " + truncated(j["error"].dump());
      return;
    }
    bool carries = false;
    if (j.contains("choices") && j["choices"].is_array()) {
      for (const json& c : j["choices"]) {
        if (!c.is_object()) continue;
        if (c.contains("token_ids") && c["token_ids"].is_array()) {
          const auto n = static_cast<int64_t>(c["token_ids"].size());
          id_tokens += n;
          carries = carries || n > 0;
        } else if (c.contains("text") && c["text"].is_string()) {
          carries = carries || !c["text"].get_ref<const std::string&>().empty();
        }
        if (c.contains("text") && c["text"].is_string()) rec.text += c["text"].get_ref<const std::string&>();
      }
    }
    if (carries) {
      if (!got_first) {
        got_first = true;
        rec.ttft_s = seconds_between(start, now);
      } else {
        rec.itl_s.push_back(seconds_between(last, now));
      }
      last = now;
      ++token_chunks;
    }
    if (j.contains("usage") && j["usage"].is_object()) {
      const json& u = j["usage"];
      if (u.contains("completion_tokens") && u["completion_tokens"].is_number_integer())
        usage_tokens = u["completion_tokens"].get<int64_t>();
      if (u.contains("prompt_tokens") && u["prompt_tokens"].is_number_integer())
        usage_prompt = u["prompt_tokens"].get<int64_t>();
    }
  };

  start = Clock::now();
  rec.send_s = seconds_between(bench_start, start);
  const auto deadline = start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
  hr.response_handler = [&](const httplib::Response& r) {
    status = r.status;
    return true;
  };
  hr.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    now = Clock::now();
    if (status != 200) {
      if (error_body.size() < kMaxErrorBody + 1) error_body.append(data, std::min(n, kMaxErrorBody + 1));
      return true;
    }
    sse.feed(std::string_view(data, n), on_event);
    if (!stream_error.empty()) return false;
    if (now > deadline && !done) {
      timed_out = true;
      return false;
    }
    return true;
  };
  const auto res = cli.send(hr);
  const auto finish = Clock::now();
  if (timed_out || (!done && finish >= deadline)) {
    rec.error = base::strprintf("timed out after %g s (--timeout)", timeout_s);
  } else if (!stream_error.empty()) {
    rec.error = stream_error;
  } else if (status != 0 && status != 200) {
    rec.error = "HTTP " + std::to_string(status) + ": " + truncated(error_body);
  } else if (!res) {
    rec.error = "transport error: " + httplib::to_string(res.error());
  } else if (!done) {
    rec.error = "the stream ended before data: [DONE] (" + std::to_string(token_chunks) + " token chunks)";
  } else if (!got_first) {
    rec.error = "the stream carried no tokens";
  }
  if (!rec.error.empty()) {
    rec.e2e_s = seconds_between(start, finish);
    return rec;
  }
  rec.ok = true;
  // Counted again through --tokenizer after the run when it says "chunks" (not on this thread,
  // which times the next request).
  if (usage_tokens >= 0) {
    rec.output_tokens = usage_tokens;
    rec.output_counted_by = "usage";
  } else if (id_tokens > 0) {
    rec.output_tokens = id_tokens;
    rec.output_counted_by = "token_ids";
  } else {
    rec.output_tokens = token_chunks;
    rec.output_counted_by = "chunks";
  }
  if (!req.tokens_exact && usage_prompt > 0) {  // the server's count beats a count of words
    rec.prompt_tokens = usage_prompt;
    rec.prompt_tokens_from_usage = true;
  }
  rec.e2e_s = seconds_between(start, end);
  return rec;
}

void check_options(const HttpBenchOptions& o) {
  TESSERA_CHECK(!o.url.empty(), "bench serve: --url is empty");
  TESSERA_CHECK(o.num_requests >= 1, "--num-requests must be >= 1, got ", o.num_requests);
  TESSERA_CHECK(o.prompt_len.min >= 1 && o.prompt_len.max >= o.prompt_len.min, "--prompt-len ", o.prompt_len.min,
                ":", o.prompt_len.max, " must satisfy 1 <= min <= max");
  TESSERA_CHECK(o.output_len.min >= 1 && o.output_len.max >= o.output_len.min, "--output-len ", o.output_len.min,
                ":", o.output_len.max, " must satisfy 1 <= min <= max");
  TESSERA_CHECK(o.shared_prefix >= 0, "--shared-prefix must not be negative, got ", o.shared_prefix);
  TESSERA_CHECK(o.dataset.empty() || o.dataset == "random" || o.dataset == "shared-prefix" || o.dataset == "text",
                "--dataset must be random, shared-prefix or text, got '", o.dataset, "'");
  TESSERA_CHECK(o.dataset_path.empty() || o.dataset.empty() || o.dataset == "text", "--dataset-path needs --dataset ",
                "text (or no --dataset), got --dataset ", o.dataset);
  TESSERA_CHECK(o.dataset != "text" || !o.dataset_path.empty(), "--dataset text needs --dataset-path FILE");
  TESSERA_CHECK((o.dataset != "random" && o.dataset != "text" && o.dataset_path.empty()) || o.shared_prefix == 0,
                "--shared-prefix ", o.shared_prefix, " needs --dataset shared-prefix (or no --dataset)");
  TESSERA_CHECK(o.dataset != "shared-prefix" || o.shared_prefix > 0,
                "--dataset shared-prefix needs --shared-prefix N >= 1");
  TESSERA_CHECK(o.request_rate > 0, "--request-rate must be > 0 requests/s (or inf), got ", o.request_rate);
  TESSERA_CHECK(o.max_concurrency >= 0, "--max-concurrency must be >= 1 (or 0 for unlimited), got ",
                o.max_concurrency);
  TESSERA_CHECK(o.timeout_s > 0 && std::isfinite(o.timeout_s), "--timeout must be > 0 seconds, got ", o.timeout_s);
}

}  // namespace

std::vector<double> poisson_arrival_times(int64_t n, double rate, uint64_t seed) {
  std::vector<double> t(static_cast<size_t>(std::max<int64_t>(n, 0)), 0.0);
  if (std::isinf(rate)) return t;
  TESSERA_CHECK(rate > 0, "--request-rate must be > 0, got ", rate);
  std::mt19937_64 rng(seed);
  std::exponential_distribution<double> gap(rate);
  for (size_t i = 1; i < t.size(); ++i) t[i] = t[i - 1] + gap(rng);
  return t;
}

void SseParser::feed(std::string_view bytes, const std::function<void(const std::string&)>& on_event) {
  buf_.append(bytes.data(), bytes.size());
  size_t pos = 0;
  for (;;) {
    const size_t nl = buf_.find('\n', pos);
    if (nl == std::string::npos) break;
    std::string_view line(buf_.data() + pos, nl - pos);
    pos = nl + 1;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty()) {  // the event ends
      if (has_data_) on_event(data_);
      data_.clear();
      has_data_ = false;
      continue;
    }
    if (line.substr(0, 5) != "data:") continue;  // comments (":"), event:, id:, retry:
    std::string_view value = line.substr(5);
    if (!value.empty() && value.front() == ' ') value.remove_prefix(1);
    if (has_data_) data_ += '\n';
    data_.append(value.data(), value.size());
    has_data_ = true;
  }
  buf_.erase(0, pos);
}

HttpBenchResult run_http_bench(const HttpBenchOptions& opts) {
  check_options(opts);
  HttpBenchResult r;
  r.options = opts;
  HttpBenchOptions& o = r.options;
  if (o.dataset.empty())
    o.dataset = !o.dataset_path.empty() ? "text" : o.shared_prefix > 0 ? "shared-prefix" : "random";
  r.url = o.url;
  const Target target = parse_target(o.url, o.api_key);
  // Local inputs first: a bad flag fails before the server is asked anything.
  std::optional<io::Tokenizer> tok;
  if (!o.tokenizer.empty()) tok = load_bench_tokenizer(o.tokenizer);
  if (!o.dataset_path.empty()) {
    std::error_code ec;
    TESSERA_CHECK(std::filesystem::is_regular_file(o.dataset_path, ec), "--dataset-path ", o.dataset_path,
                  ": no such file");
  }
  const ModelInfo info = fetch_model(target, o.url, o.model, o.timeout_s);
  r.model = info.id;
  r.vocab_size = info.vocab_size;
  r.vocab_from = info.vocab_from;
  if (r.vocab_size == 0 && tok) {
    r.vocab_size = tok->vocab_size();
    r.vocab_from = "--tokenizer";
  }
  TESSERA_CHECK(r.vocab_size > 0 || o.dataset == "text", "bench serve: ", o.url, " does not say the vocabulary size of '",
                r.model, "' (no \"vocab_size\" or \"meta.n_vocab\" in /v1/models): pass --tokenizer DIR (the ",
                "model's Hugging Face directory) or --dataset-path FILE (a text file to cut prompts from)");
  r.max_model_len = info.max_model_len;
  r.max_model_len_from = info.max_model_len_from;

  // Without a tokenizer, random prompts are the offline bench's token ids for the same seed.
  HttpPrompt warmup;
  const std::vector<HttpPrompt> reqs = make_http_prompts(o, tok ? &*tok : nullptr, r.vocab_size, r.max_model_len, &warmup);
  r.prompt_format = warmup.as_text ? "text" : "token ids";
  // A separate stream for the gaps: lengths and tokens do not depend on the rate.
  const std::vector<double> arrival = poisson_arrival_times(o.num_requests, o.request_rate, o.seed ^ 0x9e3779b97f4a7c15ull);

  if (o.warmup) {
    auto cli = make_client(target, o.timeout_s);
    const auto w = send_request(*cli, target, r.model, warmup, o.timeout_s, Clock::now());
    TESSERA_CHECK(w.ok, "bench serve: the warm-up request to ", o.url, " failed: ", w.error);
  }

  const int64_t n = o.num_requests;
  r.workers = o.max_concurrency > 0 ? std::min(o.max_concurrency, n) : std::min(n, kMaxWorkers);
  r.requests.resize(static_cast<size_t>(n));
  std::vector<double> end_s(static_cast<size_t>(n), 0.0);
  std::atomic<int64_t> next{0}, in_flight{0}, max_in_flight{0}, finished{0};
  std::mutex mu;
  std::condition_variable cv;
  bool go = false;
  Clock::time_point t0;
  auto worker = [&] {
    auto cli = make_client(target, o.timeout_s);
    {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return go; });
    }
    for (;;) {
      const int64_t i = next.fetch_add(1);
      if (i >= n) break;
      const auto at = static_cast<size_t>(i);
      std::this_thread::sleep_until(t0 + std::chrono::duration_cast<Clock::duration>(
                                              std::chrono::duration<double>(arrival[at])));
      const int64_t now_in_flight = ++in_flight;
      int64_t seen = max_in_flight.load();
      while (now_in_flight > seen && !max_in_flight.compare_exchange_weak(seen, now_in_flight)) {
      }
      r.requests[at] = send_request(*cli, target, r.model, reqs[at], o.timeout_s, t0);
      r.requests[at].arrival_s = arrival[at];
      end_s[at] = seconds_between(t0, Clock::now());
      --in_flight;
      {
        std::lock_guard<std::mutex> lock(mu);
        ++finished;
      }
      cv.notify_all();
    }
  };
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(r.workers));
  for (int64_t k = 0; k < r.workers; ++k) threads.emplace_back(worker);
  {
    std::lock_guard<std::mutex> lock(mu);
    t0 = Clock::now();
    go = true;
  }
  cv.notify_all();
  {
    std::optional<base::ProgressBar> bar;
    if (o.progress) bar.emplace("bench serve: " + o.url, n);
    std::unique_lock<std::mutex> lock(mu);
    while (finished.load() < n) {
      cv.wait_for(lock, std::chrono::milliseconds(200));
      if (bar && finished.load() < n) bar->update(finished.load());
    }
    if (bar) bar->finish();
  }
  for (auto& th : threads) th.join();
  r.max_in_flight = max_in_flight.load();

  // Outputs the server counted nowhere: re-encode the streamed text, as benchmark_serving does.
  std::vector<std::string> counted_by;
  int64_t from_usage = 0, from_words = 0;
  for (int64_t i = 0; i < n; ++i) {
    HttpRequestRecord& q = r.requests[static_cast<size_t>(i)];
    if (!q.ok) continue;
    if (q.output_counted_by == "chunks" && tok && !q.text.empty()) {
      q.output_tokens = static_cast<int64_t>(tok->encode(q.text, false).size());
      q.output_counted_by = "tokenizer";
    }
    if (std::find(counted_by.begin(), counted_by.end(), q.output_counted_by) == counted_by.end())
      counted_by.push_back(q.output_counted_by);
    if (!reqs[static_cast<size_t>(i)].tokens_exact) ++(q.prompt_tokens_from_usage ? from_usage : from_words);
  }
  for (const auto& c : counted_by) r.output_tokens_from += (r.output_tokens_from.empty() ? "" : "+") + c;
  r.prompt_tokens_from = !warmup.as_text ? "token ids"
                         : tok            ? "tokenizer"
                         : from_usage == 0 ? "words"
                         : from_words == 0 ? "usage"
                                           : "usage+words";
  std::vector<double> ttft, tpot, itl, e2e;
  for (int64_t i = 0; i < n; ++i) {
    const HttpRequestRecord& q = r.requests[static_cast<size_t>(i)];
    r.seconds = std::max(r.seconds, end_s[static_cast<size_t>(i)]);
    if (!q.ok) {
      ++r.failed;
      if (r.failures.size() < kMaxFailuresShown) r.failures.push_back("request " + std::to_string(i) + ": " + q.error);
      continue;
    }
    ++r.completed;
    r.prompt_tokens += q.prompt_tokens;
    r.output_tokens += q.output_tokens;
    if (q.output_tokens < q.max_tokens) ++r.short_outputs;
    ttft.push_back(q.ttft_s);
    e2e.push_back(q.e2e_s);
    if (q.output_tokens > 1) tpot.push_back((q.e2e_s - q.ttft_s) / static_cast<double>(q.output_tokens - 1));
    itl.insert(itl.end(), q.itl_s.begin(), q.itl_s.end());
  }
  if (r.seconds > 0) {
    r.request_throughput = static_cast<double>(r.completed) / r.seconds;
    r.output_tokens_per_s = static_cast<double>(r.output_tokens) / r.seconds;
    r.total_tokens_per_s = static_cast<double>(r.prompt_tokens + r.output_tokens) / r.seconds;
  }
  r.ttft = infer::percentiles(ttft);
  r.tpot = infer::percentiles(tpot);
  r.itl = infer::percentiles(itl);
  r.e2e = infer::percentiles(e2e);
  return r;
}

}  // namespace tessera::serve
