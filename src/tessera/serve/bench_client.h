// `tessera bench serve --url`: a load generator that drives a running OpenAI-compatible server
// over HTTP as vLLM's benchmark_serving.py does (streaming completions, Poisson arrivals, a
// concurrency cap) and reports throughput and TTFT / TPOT / ITL / end-to-end latency.
#pragma once
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "tessera/infer/bench_serve.h"

namespace tessera::serve {

struct HttpBenchOptions {
  std::string url;      // http://HOST:PORT[/prefix]; a trailing "/v1" is dropped
  std::string api_key;  // sent as "Authorization: Bearer KEY" when non-empty
  std::string model;    // the served model id; "" = the first of GET /v1/models
  std::string dataset;  // "random" or "shared-prefix"; "" = shared-prefix iff shared_prefix > 0
  int64_t num_requests = 32;
  infer::LengthRange prompt_len{128, 128};  // unique tokens per prompt (after the shared prefix)
  infer::LengthRange output_len{128, 128};  // max_tokens, with ignore_eos
  int64_t shared_prefix = 0;                // tokens every prompt starts with
  double request_rate = std::numeric_limits<double>::infinity();  // requests/s; inf = all at t=0
  int64_t max_concurrency = 0;  // requests in flight at most; 0 = unlimited (capped at kMaxWorkers)
  uint64_t seed = 0;            // prompts and lengths (as the offline bench), arrival gaps
  double timeout_s = 600;       // per request, from sending it to the end of its stream
  bool warmup = true;           // send the offline bench's warm-up request first, untimed
  bool progress = true;         // a progress line on stderr
};

// Threads that send requests at most (one per request in flight).
inline constexpr int64_t kMaxWorkers = 512;

// One measured request. Times are seconds; send_s is from the benchmark's start.
struct HttpRequestRecord {
  bool ok = false;
  std::string error;  // failed: "HTTP 429: {body}", a transport error, a timeout, ...
  int64_t prompt_tokens = 0, max_tokens = 0;
  int64_t output_tokens = 0;  // usage.completion_tokens, else the sum of chunks' token_ids
  double arrival_s = 0;       // when it was due (the Poisson schedule)
  double send_s = 0;          // when it was sent: arrival, or later when all slots were busy
  double ttft_s = 0;          // send -> first chunk carrying tokens (includes server queueing)
  double e2e_s = 0;           // send -> end of the stream (data: [DONE])
  std::vector<double> itl_s;  // gaps between successive chunks carrying tokens
};

struct HttpBenchResult {
  HttpBenchOptions options;  // as run (dataset resolved)
  std::string url, model;
  int64_t vocab_size = 0, max_model_len = 0;  // from GET /v1/models
  int64_t workers = 0;                        // sending threads (= the concurrency cap)
  int64_t completed = 0, failed = 0;
  int64_t short_outputs = 0;  // completed with fewer tokens than max_tokens
  std::vector<std::string> failures;  // the first few failure messages, "request i: ..."
  int64_t prompt_tokens = 0, output_tokens = 0;  // completed requests only
  double seconds = 0;  // first send -> last request's end
  double request_throughput = 0, output_tokens_per_s = 0, total_tokens_per_s = 0;
  infer::Percentiles ttft, tpot, itl, e2e;  // seconds; TPOT = (e2e - ttft) / (outputs - 1)
  int64_t max_in_flight = 0;                // most requests in flight at once, client side
  std::vector<HttpRequestRecord> requests;  // per request, in request order
};

// Seconds from the start at which each of n requests arrives: 0, then gaps drawn from an
// exponential distribution of mean 1/rate (a Poisson process), from `seed`; all 0 when rate
// is infinite.
std::vector<double> poisson_arrival_times(int64_t n, double rate, uint64_t seed);

// Splits a server-sent-events byte stream into the values of its events' "data:" fields
// (multi-line data joined by "\n"); bytes may arrive split anywhere. Comments and other
// fields are skipped; an event is dispatched at the blank line that ends it.
class SseParser {
 public:
  void feed(std::string_view bytes, const std::function<void(const std::string& data)>& on_event);

 private:
  std::string buf_;   // bytes after the last complete line
  std::string data_;  // the current event's data so far
  bool has_data_ = false;
};

// Reads GET /v1/models, sends the warm-up request, then the measured requests. Throws
// tessera::Error (one line) on bad options, an unreachable URL, a non-200 /v1/models or a
// failed warm-up; failures of measured requests are counted in the result instead.
HttpBenchResult run_http_bench(const HttpBenchOptions& o);

std::string format_http_bench(const HttpBenchResult& r);  // the human report, many lines
std::string http_bench_json(const HttpBenchResult& r);    // one JSON object, one line

}  // namespace tessera::serve
