// bench serve --url's report: the human summary and the one-line JSON of an HttpBenchResult.
#include <cmath>
#include <cstdio>
#include <string>

#include <nlohmann/json.hpp>

#include "tessera/base/strings.h"
#include "tessera/serve/bench_client.h"

namespace tessera::serve {
namespace {

using nlohmann::json;

std::string range_text(const infer::LengthRange& r) {
  return r.min == r.max ? std::to_string(r.min) : std::to_string(r.min) + ":" + std::to_string(r.max);
}

// The prompt lengths: the range, or the --prompt-len-mix spec.
std::string prompt_text(const HttpBenchOptions& o) {
  if (o.prompt_mix.empty()) return range_text(o.prompt_len);
  std::string s = "mix ";
  for (size_t i = 0; i < o.prompt_mix.size(); ++i)
    s += base::strprintf("%s%lld:%g", i ? "," : "", (long long)o.prompt_mix[i].first, o.prompt_mix[i].second);
  return s;
}

}  // namespace

std::string format_http_bench(const HttpBenchResult& r) {
  const HttpBenchOptions& o = r.options;
  std::string s;
  const std::string vocab =
      r.vocab_size > 0 ? std::to_string(r.vocab_size) + " from " + r.vocab_from : std::string("unknown");
  const std::string max_len = r.max_model_len_from.empty()
                                  ? std::string("not reported")
                                  : std::to_string(r.max_model_len) + " from " + r.max_model_len_from;
  s += base::strprintf("server: %s, model %s (vocab %s, max_model_len %s)\n", r.url.c_str(), r.model.c_str(),
           vocab.c_str(), max_len.c_str());
  const bool words = o.dataset == "text" && o.tokenizer.empty();
  s += base::strprintf("requests: %lld (%s%s%s), prompt %s %s, output %s tokens, shared prefix %lld, seed %llu\n",
           (long long)o.num_requests, o.dataset.c_str(), o.dataset_path.empty() ? "" : " ",
           o.dataset_path.c_str(), prompt_text(o).c_str(), words ? "words" : "tokens",
           range_text(o.output_len).c_str(), (long long)o.shared_prefix, (unsigned long long)o.seed);
  s += base::strprintf("prompts: %s%s; prompt tokens counted from %s, output tokens from %s\n",
           r.prompt_format.c_str(), o.tokenizer.empty() ? "" : (" (--tokenizer " + o.tokenizer + ")").c_str(),
           r.prompt_tokens_from.c_str(), r.output_tokens_from.empty() ? "-" : r.output_tokens_from.c_str());
  s += base::strprintf("load: request rate %s, max concurrency %s (%lld sending threads, at most %lld in flight)\n",
           std::isinf(o.request_rate) ? "inf (all at t=0)" : base::strprintf("%.2f/s (Poisson)", o.request_rate).c_str(),
           o.max_concurrency > 0 ? std::to_string(o.max_concurrency).c_str() : "unlimited",
           (long long)r.workers, (long long)r.max_in_flight);
  s += base::strprintf("[http] %lld completed, %lld failed in %.2f s\n", (long long)r.completed, (long long)r.failed, r.seconds);
  s += base::strprintf("  throughput: %.2f requests/s, output %.1f tokens/s, total %.1f tokens/s (%lld prompt + %lld "
           "output tokens)\n",
           r.request_throughput, r.output_tokens_per_s, r.total_tokens_per_s, (long long)r.prompt_tokens,
           (long long)r.output_tokens);
  auto pct = [&](const char* name, const infer::Percentiles& q, const char* note) {
    s += base::strprintf("  %-4s (ms): p50 %.1f  p90 %.1f  p99 %.1f  mean %.1f%s\n", name, q.p50 * 1e3, q.p90 * 1e3,
             q.p99 * 1e3, q.mean * 1e3, note);
  };
  pct("ttft", r.ttft, "  (TTFT includes server queueing)");
  pct("tpot", r.tpot, "");
  pct("itl", r.itl, "");
  pct("e2e", r.e2e, "");
  if (r.short_outputs > 0)
    s += base::strprintf("  warning: %lld completed requests returned fewer tokens than max_tokens\n", (long long)r.short_outputs);
  for (const auto& f : r.failures) s += "  failed: " + f + "\n";
  if (r.failed > static_cast<int64_t>(r.failures.size()))
    s += base::strprintf("  ... and %lld more failures\n", (long long)(r.failed - static_cast<int64_t>(r.failures.size())));
  return s;
}

std::string http_bench_json(const HttpBenchResult& r) {
  const HttpBenchOptions& o = r.options;
  auto pj = [](const infer::Percentiles& q) {
    return json{{"p50", q.p50}, {"p90", q.p90}, {"p99", q.p99}, {"mean", q.mean}};
  };
  json j{{"url", r.url},
         {"model", r.model},
         {"vocab_size", r.vocab_size},
         {"vocab_from", r.vocab_from},
         {"max_model_len", r.max_model_len_from.empty() ? json(nullptr) : json(r.max_model_len)},
         {"max_model_len_from", r.max_model_len_from},
         {"dataset", o.dataset},
         {"dataset_path", o.dataset_path},
         {"tokenizer", o.tokenizer},
         {"prompt_format", r.prompt_format},
         {"prompt_tokens_from", r.prompt_tokens_from},
         {"output_tokens_from", r.output_tokens_from},
         {"num_requests", o.num_requests},
         {"prompt_len", prompt_text(o)},
         {"output_len", range_text(o.output_len)},
         {"shared_prefix", o.shared_prefix},
         {"seed", o.seed},
         {"request_rate", std::isinf(o.request_rate) ? json("inf") : json(o.request_rate)},
         {"max_concurrency", o.max_concurrency},
         {"workers", r.workers},
         {"max_in_flight", r.max_in_flight},
         {"completed", r.completed},
         {"failed", r.failed},
         {"failures", r.failures},
         {"short_outputs", r.short_outputs},
         {"prompt_tokens", r.prompt_tokens},
         {"output_tokens", r.output_tokens},
         {"seconds", r.seconds},
         {"request_throughput", r.request_throughput},
         {"output_tokens_per_s", r.output_tokens_per_s},
         {"total_tokens_per_s", r.total_tokens_per_s},
         {"ttft_s", pj(r.ttft)},
         {"tpot_s", pj(r.tpot)},
         {"itl_s", pj(r.itl)},
         {"e2e_s", pj(r.e2e)},
         {"ttft_includes_queueing", true}};
  return j.dump();
}

}  // namespace tessera::serve
