// `tessera bench serve`: the offline serving benchmark. N seeded random requests go into one
// engine at t = 0; it reports throughput, TTFT / TPOT / end-to-end percentiles, prefix-cache
// hits, preemptions, speculative acceptance and KV fragmentation, and runs a one-at-a-time
// baseline through the same model and engine config in the same run. See docs/performance.md.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "tessera/infer/engine.h"
#include "tessera/model/model.h"

namespace tessera::infer {

// A token count drawn uniformly from [min, max] (min == max: fixed).
struct LengthRange {
  int64_t min = 128, max = 128;
};
// "128" or "64:192"; errors name `flag` and the text.
LengthRange parse_length_range(const std::string& text, const std::string& flag);

struct ServeBenchOptions {
  std::string model_dir;        // load this, or build `shape` with random weights
  std::string shape = "small";
  DType dtype = DType::kF32;
  std::string draft_model_dir;  // speculative_method "draft"
  uint64_t model_seed = 1234;   // random weights (as the other benchmarks)

  int64_t num_requests = 32;
  LengthRange prompt_len{128, 128};  // unique tokens per prompt (after the shared prefix)
  LengthRange output_len{128, 128};  // greedy, ignore_eos: exactly this many tokens
  int64_t shared_prefix = 0;         // tokens every prompt starts with
  // Distinct shared prefixes (of shared_prefix tokens each): request i starts with prefix
  // i % num_prefixes, and the warm-up computes each of them once. Prefixes that together
  // exceed the KV pool are what the host / disk tiers are for.
  int64_t num_prefixes = 1;
  bool compare_kv_tiers = false;     // measured phase again without the host / disk tiers
  bool compare_preemption = false;   // measured phase again with the other --preemption
  bool repetitive_prompts = false;   // prompts repeat a random segment (n-gram lookup finds it)
  int64_t repeat_segment = 16;       // that segment's length
  int64_t baseline_requests = -1;    // one-at-a-time baseline; -1: min(N, 4); 0: skip it
  bool compare_prefix_caching = false;  // measured phase again with prefix caching flipped
  bool compare_speculative = false;     // measured phase again without speculative decoding
  // Measured phase again with the KV cache in this dtype (same byte budget), e.g. bf16
  // against --kv-cache-dtype int8.
  std::optional<kernels::KvCacheDtype> compare_kv_cache_dtype;
  // Multi-LoRA (--lora-adapters K): K random adapters of rank lora_rank on every module; the
  // measured phase runs every request on adapter 0, then again spread over the K adapters
  // (request i on adapter i % K), and the report gives the ratio of the two.
  int64_t lora_adapters = 0;
  int64_t lora_rank = 16;
  int64_t lora_repeats = 3;  // both phases alternately this many times; each reports its median run
  uint64_t seed = 0;                 // prompts and lengths
  EngineConfig engine;               // block size, pool, budgets, prefix caching, speculation
};

// One benchmark request: prompt token ids, and the output length (greedy, EOS ignored).
struct BenchRequest {
  std::vector<int32_t> prompt;
  int64_t max_tokens = 0;
};
// o.num_requests seeded requests (o.seed, prompt_len, output_len, shared_prefix,
// repetitive_prompts; token ids from [3, vocab)), then the warm-up request in *warmup (the
// shared prefix + 16 other tokens, one output token). Shared with `bench serve --url` so the
// HTTP and offline benchmarks send identical requests. Throws when one exceeds max_len.
// more_warmups: with num_prefixes > 1, one warm-up request per further prefix.
std::vector<BenchRequest> make_bench_requests(const ServeBenchOptions& o, int64_t vocab, int64_t max_len,
                                              BenchRequest* warmup, std::vector<BenchRequest>* more_warmups = nullptr);

struct Percentiles {  // linear interpolation between order statistics (numpy's default)
  double p50 = 0, p90 = 0, p99 = 0, mean = 0;
};
Percentiles percentiles(std::vector<double> values);  // all zero when empty

// One measured phase: requests submitted together (or one at a time for the baseline).
struct PhaseResult {
  std::string label;  // "concurrent", "no prefix caching", "no speculation", "one-at-a-time"
  bool prefix_caching = true;
  std::string speculative;  // method or "" (off)
  int64_t num_requests = 0, prompt_tokens = 0, output_tokens = 0;  // prompt: incl. shared prefix
  double seconds = 0;
  double total_tokens_per_s = 0, output_tokens_per_s = 0;
  Percentiles ttft, tpot, e2e;  // seconds; TPOT = (finish - first token) / (outputs - 1)
  int64_t steps = 0;
  int64_t prefix_hit_blocks = 0, prefix_lookup_blocks = 0;  // measured requests only
  double prefix_hit_rate = 0;                               // hit / looked-up blocks
  int64_t cached_prompt_tokens = 0;  // prompt tokens served from the prefix cache
  int64_t preemptions = 0;
  int64_t computed_tokens = 0;  // tokens the model ran (prompts after cache hits, recompute, decodes)
  // Tiered KV cache: the config in words ("host 64.0 MB, preemption swap"), blocks served from
  // each tier, preemptions by swap and the blocks they moved, bytes between pool and tiers.
  std::string kv_tiers;
  int64_t host_hit_blocks = 0, disk_hit_blocks = 0, swapped_preemptions = 0, swap_out_blocks = 0,
          swap_in_blocks = 0, bytes_to_tiers = 0, bytes_from_tiers = 0;
  int64_t spec_steps = 0, spec_proposed = 0, spec_accepted = 0;
  double spec_acceptance_rate = 0;   // accepted / proposed
  double spec_mean_accepted = 0;     // accepted proposals per verification step
  // KV fragmentation, sampled after every step with running sequences: unused slots of the
  // blocks the running sequences hold (paged), and of a contiguous max_model_len reservation
  // per running sequence; mean over steps and max.
  double frag_mean = 0, frag_max = 0;
  double contiguous_frag_mean = 0, contiguous_frag_max = 0;
  int64_t kv_blocks_peak = 0;  // most blocks held by running sequences at once
};

struct ServeBenchResult {
  std::string model;  // shape name or directory
  int64_t num_parameters = 0;
  int64_t kv_blocks_total = 0, kv_bytes_total = 0, block_size = 0, max_model_len = 0;
  ServeBenchOptions options;
  PhaseResult main;
  std::optional<PhaseResult> prefix_flipped;  // --compare-prefix-caching
  std::optional<PhaseResult> no_speculation;  // --compare-speculative
  std::optional<PhaseResult> other_kv_dtype;  // --compare-kv-cache-dtype
  int64_t other_kv_blocks_total = 0;
  double kv_dtype_speedup = 0;                // total tokens/s, main / other_kv_dtype
  std::optional<PhaseResult> lora_spread;     // --lora-adapters: requests over K adapters
  double lora_spread_ratio = 0;               // output tokens/s, K adapters / one adapter
  double lora_tpot_ratio = 0;                 // TPOT p50, one adapter / K adapters
  std::optional<PhaseResult> no_tiers;        // --compare-kv-tiers
  double ttft_p50_no_tiers_over_tiers = 0, throughput_tiers_over_no_tiers = 0;
  std::optional<PhaseResult> other_preemption;  // --compare-preemption
  double throughput_swap_over_recompute = 0, ttft_p50_recompute_over_swap = 0;
  std::optional<PhaseResult> baseline;        // one at a time
  double speedup_vs_one_at_a_time = 0;        // main / baseline total tokens/s
  double ttft_p50_off_over_on = 0;            // prefix caching off / on
  double spec_speedup = 0;                    // output tokens/s with / without speculation
};

// Loads o.model_dir (or builds a random o.shape) and the draft model, then runs.
ServeBenchResult run_serve_bench(const ServeBenchOptions& o);
ServeBenchResult run_serve_bench(const model::Model& model, const ServeBenchOptions& o,
                                 const model::Model* draft = nullptr, const std::string& name = "");

std::string format_serve_bench(const ServeBenchResult& r);  // the human report, many lines
std::string serve_bench_json(const ServeBenchResult& r);    // one JSON object, one line

}  // namespace tessera::infer
