// `tessera bench serve`: the offline serving benchmark (infer/bench_serve.h) with a
// one-at-a-time baseline in the same run; see docs/performance.md. With --url it is instead
// the HTTP load generator (serve/bench_client.h) against a running server; see docs/inference.md.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "tessera/base/error.h"
#include "tessera/cli/commands.h"
#include "tessera/infer/bench_serve.h"
#include "tessera/serve/bench_client.h"

namespace tessera::cli {
namespace {

struct ServeFlags {
  infer::ServeBenchOptions o;
  std::string dtype = "f32";
  std::string prompt_len = "128", output_len = "128";
  int64_t kv_cache_memory = 0;
  bool no_prefix_caching = false;
  std::string speculative;
  int64_t num_speculative_tokens = 4;
  bool json = false;
  // --url mode (the HTTP load generator)
  serve::HttpBenchOptions http;
  std::string request_rate = "inf";
  std::string prompt_mix;  // --prompt-len-mix
  std::vector<std::string> given;  // the flags given on the command line
};

// Flags of one mode only; the other mode refuses them rather than ignoring them.
const char* const kOfflineOnly[] = {"--shape", "--dtype", "--repetitive-prompts", "--repeat-segment",
                                    "--max-num-seqs", "--max-num-batched-tokens", "--max-model-len",
                                    "--kv-cache-memory", "--kv-cache-dtype", "--compare-kv-cache-dtype",
                                    "--block-size", "--no-prefix-caching",
                                    "--compare-prefix-caching", "--speculative", "--num-speculative-tokens",
                                    "--draft-model", "--compare-speculative", "--baseline-requests",
                                    "--kv-host-memory", "--kv-offload-dir", "--kv-offload-size", "--preemption",
                                    "--num-prefixes", "--compare-kv-tiers", "--compare-preemption"};
const char* const kUrlOnly[] = {"--dataset", "--prompt-len-mix", "--dataset-path", "--tokenizer", "--request-rate",
                                "--max-concurrency", "--api-key", "--timeout"};

bool was_given(const ServeFlags& f, const std::string& flag) {
  for (const auto& g : f.given)
    if (g == flag) return true;
  return false;
}

double parse_request_rate(const std::string& text) {
  if (text == "inf") return std::numeric_limits<double>::infinity();
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  TESSERA_CHECK(used > 0 && used == text.size() && v > 0 && !std::isnan(v), "--request-rate: '", text,
                "' is not a rate > 0 in requests/s (or inf)");
  return v;
}

int run_bench_http(ServeFlags& f) {
  for (const char* flag : kOfflineOnly)
    TESSERA_CHECK(!was_given(f, flag), "bench serve: ", flag,
                  " has no effect with --url (set the engine on `tessera serve`)");
  serve::HttpBenchOptions& h = f.http;
  h.model = f.o.model_dir;  // --model: the served model's id here
  h.num_requests = f.o.num_requests;
  h.prompt_len = infer::parse_length_range(f.prompt_len, "--prompt-len");
  if (!f.prompt_mix.empty()) {
    TESSERA_CHECK(!was_given(f, "--prompt-len"), "give --prompt-len or --prompt-len-mix, not both");
    h.prompt_mix = serve::parse_prompt_mix(f.prompt_mix);
  }
  h.output_len = infer::parse_length_range(f.output_len, "--output-len");
  h.shared_prefix = f.o.shared_prefix;
  h.seed = f.o.seed;
  h.request_rate = parse_request_rate(f.request_rate);
  if (h.api_key.empty())
    if (const char* k = std::getenv("TESSERA_API_KEY"); k && *k) h.api_key = k;
  const auto r = serve::run_http_bench(h);
  std::fputs(serve::format_http_bench(r).c_str(), stdout);
  if (f.json) std::printf("%s\n", serve::http_bench_json(r).c_str());
  std::fflush(stdout);
  if (r.failed > 0) {
    std::fprintf(stderr, "bench serve: %lld of %lld requests failed\n", (long long)r.failed,
                 (long long)h.num_requests);
    return 1;
  }
  return 0;
}

int run_bench_serve(ServeFlags f) {
  if (!f.http.url.empty()) return run_bench_http(f);
  for (const char* flag : kUrlOnly) TESSERA_CHECK(!was_given(f, flag), "bench serve: ", flag, " needs --url");
  infer::ServeBenchOptions& o = f.o;
  o.dtype = parse_dtype(f.dtype);
  o.prompt_len = infer::parse_length_range(f.prompt_len, "--prompt-len");
  o.output_len = infer::parse_length_range(f.output_len, "--output-len");
  TESSERA_CHECK(f.kv_cache_memory >= 0, "--kv-cache-memory must not be negative, got ", f.kv_cache_memory);
  o.engine.kv_cache_memory = f.kv_cache_memory;
  o.engine.prefix_caching = !f.no_prefix_caching;
  TESSERA_CHECK(f.speculative.empty() || f.speculative == "ngram" || f.speculative == "draft",
                "--speculative must be ngram or draft, got '", f.speculative, "'");
  o.engine.speculative_method = f.speculative;
  o.engine.num_speculative_tokens = f.speculative.empty() ? 0 : f.num_speculative_tokens;
  const auto r = infer::run_serve_bench(o);
  std::fputs(infer::format_serve_bench(r).c_str(), stdout);
  if (f.json) std::printf("%s\n", infer::serve_bench_json(r).c_str());
  std::fflush(stdout);
  return 0;
}

}  // namespace

void add_bench_serve(CLI::App* bench, Action& action) {
  auto f = std::make_shared<ServeFlags>();
  auto& o = f->o;
  auto* c = bench->add_subcommand(
      "serve", "Offline serving engine: throughput, TTFT/TPOT, prefix cache, KV fragmentation, "
               "vs one request at a time; with --url, a load generator against a running server");
  c->add_option("--url", f->http.url,
                "Benchmark the server at this URL over HTTP (http://HOST:PORT) instead of an offline engine");
  c->add_option("--model", o.model_dir,
                "Model directory (instead of --shape); with --url: the served model id (default: the first "
                "of /v1/models)");
  c->add_option("--shape", o.shape, "Random model shape: tiny, small, 1b, gpt2-124m")->capture_default_str();
  c->add_option("--dtype", f->dtype, "Weight dtype: f32 or bf16")->capture_default_str();
  c->add_option("--num-requests", o.num_requests, "Requests, all submitted at t=0")->capture_default_str();
  c->add_option("--prompt-len", f->prompt_len, "Prompt tokens (after the shared prefix): N or MIN:MAX (uniform)")
      ->capture_default_str();
  c->add_option("--output-len", f->output_len, "Output tokens (greedy, EOS ignored): N or MIN:MAX (uniform)")
      ->capture_default_str();
  c->add_option("--shared-prefix", o.shared_prefix,
                "Tokens every prompt starts with (a warm-up request computes them first)")
      ->capture_default_str();
  c->add_flag("--repetitive-prompts", o.repetitive_prompts,
              "Build prompts by repeating a random segment (something for n-gram lookup to find)");
  c->add_option("--repeat-segment", o.repeat_segment, "Segment length for --repetitive-prompts")
      ->capture_default_str();
  c->add_option("--max-num-seqs", o.engine.max_num_seqs, "Running sequences at most")->capture_default_str();
  c->add_option("--max-num-batched-tokens", o.engine.max_num_batched_tokens, "Token budget per step")
      ->capture_default_str();
  c->add_option("--max-model-len", o.engine.max_model_len, "Context length; 0: the model's")
      ->capture_default_str();
  add_size_option(c, "--kv-cache-memory", f->kv_cache_memory, "KV pool size; 0: a fraction of free memory")
      ->capture_default_str();
  c->add_option_function<std::string>(
       "--kv-cache-dtype", [&o](const std::string& s) { o.engine.kv_cache_dtype = kernels::parse_kv_cache_dtype(s); },
       "KV cache storage: bf16 (default), int8, fp8 or f32")
      ->type_name("DTYPE");
  c->add_option_function<std::string>(
       "--compare-kv-cache-dtype",
       [&o](const std::string& s) {
         o.compare_kv_cache_dtype = kernels::parse_kv_cache_dtype(s, "--compare-kv-cache-dtype");
       },
       "Run the measured phase again with the KV cache in this dtype (same --kv-cache-memory); print the "
       "throughput ratio")
      ->type_name("DTYPE");
  c->add_option("--block-size", o.engine.block_size, "Tokens per KV block")->capture_default_str();
  add_size_option(c, "--kv-host-memory", o.engine.kv_host_memory, "Host KV tier size (0: none)")->capture_default_str();
  c->add_option("--kv-offload-dir", o.engine.kv_offload_dir, "Disk KV tier directory");
  add_size_option(c, "--kv-offload-size", o.engine.kv_offload_size, "Disk KV tier limit");
  c->add_option("--preemption", o.engine.preemption, "recompute or swap (needs --kv-host-memory)")
      ->capture_default_str();
  c->add_option("--num-prefixes", o.num_prefixes,
                "Distinct shared prefixes (request i starts with prefix i % K; each warmed up once)")
      ->capture_default_str();
  c->add_flag("--compare-kv-tiers", o.compare_kv_tiers,
              "Run the measured phase again without the host / disk tiers; print the TTFT p50 ratio");
  c->add_flag("--compare-preemption", o.compare_preemption,
              "Run the measured phase again with the other --preemption; print throughput and TTFT ratios");
  c->add_flag("--no-prefix-caching", f->no_prefix_caching, "Turn the prefix cache off");
  c->add_flag("--compare-prefix-caching", o.compare_prefix_caching,
              "Run the measured phase again with prefix caching flipped; print the TTFT p50 ratio");
  c->add_option("--speculative", f->speculative, "Speculative decoding: ngram or draft");
  c->add_option("--num-speculative-tokens", f->num_speculative_tokens, "Proposals per step")
      ->capture_default_str();
  c->add_option("--draft-model", o.draft_model_dir, "Draft model directory (--speculative draft)");
  c->add_flag("--compare-speculative", o.compare_speculative,
              "Run the measured phase again without speculation; print the speed-up");
  c->add_option("--baseline-requests", o.baseline_requests,
                "Requests the one-at-a-time baseline runs; -1: min(N, 4); 0: none")
      ->capture_default_str();
  c->add_option("--lora-adapters", o.lora_adapters,
                "Multi-LoRA: K random adapters; the requests run on one adapter, then spread over K, "
                "and the report gives the ratio")
      ->capture_default_str();
  c->add_option("--lora-rank", o.lora_rank, "Rank of the --lora-adapters adapters")->capture_default_str();
  c->add_option("--lora-repeats", o.lora_repeats,
                "--lora-adapters: both phases alternately this many times; each reports its median run")
      ->capture_default_str();
  c->add_option("--seed", o.seed, "Seed of prompts and lengths")->capture_default_str();
  c->add_flag("--json", f->json, "Also print every figure as one JSON line");
  auto& h = f->http;
  c->add_option("--dataset", h.dataset,
                "With --url: random, shared-prefix or text (default: text with --dataset-path, shared-prefix "
                "when --shared-prefix > 0, else random)");
  c->add_option("--dataset-path", h.dataset_path,
                "With --url: a plain-text file; prompts are windows of it at seeded offsets (--dataset text)");
  c->add_option("--tokenizer", h.tokenizer,
                "With --url: the model's Hugging Face directory (tokenizer.json); prompts are sent as text and "
                "lengths counted in its tokens (needed when /v1/models gives no vocabulary, as vLLM's)");
  c->add_option("--request-rate", f->request_rate,
                "With --url: Poisson arrivals at this many requests/s; inf: all at t=0")
      ->capture_default_str();
  c->add_option("--prompt-len-mix", f->prompt_mix,
                "With --url: prompt lengths LEN:WEIGHT[,LEN:WEIGHT...] drawn per request (e.g. 64:0.8,1024:0.2: "
                "long prompts among short ones), instead of --prompt-len");
  c->add_option("--max-concurrency", h.max_concurrency,
                "With --url: requests in flight at most; 0: unlimited (at most 512)")
      ->capture_default_str();
  c->add_option("--api-key", h.api_key, "With --url: sent as 'Authorization: Bearer KEY' (or env TESSERA_API_KEY)");
  c->add_option("--timeout", h.timeout_s, "With --url: seconds per request")->capture_default_str();
  c->callback([&action, f, c] {
    for (const CLI::Option* opt : c->get_options())
      if (opt->count() > 0) f->given.push_back(opt->get_name());
    action = [f] { return run_bench_serve(*f); };
  });
}

}  // namespace tessera::cli
