// `tessera bench serve --url`: a load generator that drives a running OpenAI-compatible server
// over HTTP as vLLM's benchmark_serving.py does (streaming completions, Poisson arrivals, a
// concurrency cap) and reports throughput and TTFT / TPOT / ITL / end-to-end latency. It needs
// only the standard OpenAI fields, so it drives tessera serve, vLLM and llama-server alike.
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
  // "random", "shared-prefix" or "text"; "" = text iff dataset_path is set, else shared-prefix
  // iff shared_prefix > 0, else random
  std::string dataset;
  std::string dataset_path;  // --dataset-path: a plain-text file the "text" prompts are cut from
  std::string tokenizer;     // --tokenizer: HF directory (tokenizer.json); prompts are then text
  int64_t num_requests = 32;
  infer::LengthRange prompt_len{128, 128};  // unique tokens per prompt (after the shared prefix)
  infer::LengthRange output_len{128, 128};  // max_tokens, with ignore_eos
  // --prompt-len-mix LEN:WEIGHT,...: random prompts of these lengths in these proportions
  // (drawn per request, seeded) instead of prompt_len, e.g. short chats among long documents.
  std::vector<std::pair<int64_t, double>> prompt_mix;
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
  int64_t prompt_tokens = 0, max_tokens = 0;  // prompt: the client's count (see HttpPrompt)
  // usage.completion_tokens, else the sum of chunks' token_ids, else the streamed text
  // re-encoded by --tokenizer, else the chunks that carried text
  int64_t output_tokens = 0;
  std::string output_counted_by;  // "usage", "token_ids", "tokenizer" or "chunks"
  std::string text;               // the streamed text (kept to count tokens without usage)
  bool prompt_tokens_from_usage = false;  // usage.prompt_tokens replaced an approximate count
  double arrival_s = 0;       // when it was due (the Poisson schedule)
  double send_s = 0;          // when it was sent: arrival, or later when all slots were busy
  double ttft_s = 0;          // send -> first chunk carrying tokens (includes server queueing)
  double e2e_s = 0;           // send -> end of the stream (data: [DONE])
  std::vector<double> itl_s;  // gaps between successive chunks carrying tokens
};

struct HttpBenchResult {
  HttpBenchOptions options;  // as run (dataset resolved)
  std::string url, model;
  // The vocabulary: /v1/models' "vocab_size" (tessera serve), else "meta.n_vocab"
  // (llama-server), else --tokenizer's; 0 for a text dataset without any of them.
  int64_t vocab_size = 0;
  std::string vocab_from;  // "vocab_size", "meta.n_vocab", "--tokenizer" or ""
  // "max_model_len" (tessera serve, vLLM), else llama-server's "meta.n_ctx_train", else
  // unbounded (INT64_MAX, max_model_len_from "").
  int64_t max_model_len = 0;
  std::string max_model_len_from;
  std::string prompt_format;         // "token ids" or "text"
  std::string prompt_tokens_from;    // "token ids", "tokenizer", "words" or "usage" (server's count)
  std::string output_tokens_from;    // the output_counted_by values seen, joined by "+"
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

// "64:0.8,1024:0.2" -> {(64, 0.8), (1024, 0.2)}; errors name --prompt-len-mix and the item.
std::vector<std::pair<int64_t, double>> parse_prompt_mix(const std::string& text);

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

// Loads --tokenizer and --dataset-path, reads GET /v1/models, sends the warm-up request, then
// the measured requests. Throws tessera::Error (one line) on bad options or files, an
// unreachable URL, a non-200 /v1/models, no vocabulary for random prompts (no vocab_size or
// meta.n_vocab, no --tokenizer) or a failed warm-up; failures of measured requests are
// counted in the result instead.
HttpBenchResult run_http_bench(const HttpBenchOptions& o);

std::string format_http_bench(const HttpBenchResult& r);  // the human report, many lines
std::string http_bench_json(const HttpBenchResult& r);    // one JSON object, one line

}  // namespace tessera::serve
