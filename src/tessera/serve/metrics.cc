// Prometheus metric families of the server.
#include "tessera/serve/metrics.h"

#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include "tessera/model/moe.h"

namespace tessera::serve {
namespace {

using prometheus::Histogram;

// Latency buckets (seconds) as vLLM's.
const Histogram::BucketBoundaries kTtftBuckets = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25,
                                                  0.5,   0.75,  1.0,  2.5,  5.0,  7.5,  10.0, 20.0, 40.0,
                                                  80.0,  160.0, 640.0, 2560.0};
const Histogram::BucketBoundaries kItlBuckets = {0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                                                 0.75, 1.0,   2.5,  5.0,   7.5, 10.0, 20.0, 40.0, 80.0};
const Histogram::BucketBoundaries kE2eBuckets = {0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                                                 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};
const Histogram::BucketBoundaries kTokenBuckets = {1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000,
                                                   20000, 50000, 100000};

}  // namespace

ServerMetrics::ServerMetrics(const std::string& model_name)
    : registry_(std::make_shared<prometheus::Registry>()), model_(model_name) {
  const prometheus::Labels labels = {{"model_name", model_name}};
  auto hist = [&](const char* name, const char* help, const Histogram::BucketBoundaries& b) {
    return &prometheus::BuildHistogram().Name(name).Help(help).Register(*registry_).Add(labels, b);
  };
  auto counter = [&](const char* name, const char* help) {
    return &prometheus::BuildCounter().Name(name).Help(help).Register(*registry_).Add(labels);
  };
  auto gauge = [&](const char* name, const char* help) {
    return &prometheus::BuildGauge().Name(name).Help(help).Register(*registry_).Add(labels);
  };
  ttft_ = hist("tessera_time_to_first_token_seconds", "Time from arrival to the first token, queueing included.",
               kTtftBuckets);
  itl_ = hist("tessera_inter_token_latency_seconds", "Time between successive outputs of a request.", kItlBuckets);
  e2e_ = hist("tessera_e2e_request_latency_seconds", "Time from arrival to the last token.", kE2eBuckets);
  queue_ = hist("tessera_request_queue_time_seconds", "Time from arrival to the first engine step that ran it.",
                kTtftBuckets);
  prompt_len_ = hist("tessera_request_prompt_tokens", "Prompt tokens per finished request.", kTokenBuckets);
  gen_len_ = hist("tessera_request_generation_tokens", "Generated tokens per finished request.", kTokenBuckets);
  finished_ = &prometheus::BuildCounter()
                   .Name("tessera_request_success_total")
                   .Help("Finished requests by finish reason.")
                   .Register(*registry_);
  http_ = &prometheus::BuildCounter()
               .Name("tessera_http_responses_total")
               .Help("HTTP responses by status code.")
               .Register(*registry_);
  lora_ = &prometheus::BuildCounter()
               .Name("tessera_lora_requests_total")
               .Help("Requests admitted on each LoRA adapter (multi-LoRA serving).")
               .Register(*registry_);
  prompt_tokens_ = counter("tessera_prompt_tokens_total", "Prompt tokens computed (prefix-cache hits excluded).");
  gen_tokens_ = counter("tessera_generation_tokens_total", "Tokens generated.");
  prefix_queries_ = counter("tessera_prefix_cache_queries_total", "Prompt blocks looked up in the prefix cache.");
  prefix_hits_ = counter("tessera_prefix_cache_hits_total", "Prompt blocks found in the prefix cache (pool or a lower KV tier).");
  preemptions_ = counter("tessera_num_preemptions_total", "Requests preempted (KV blocks freed, recomputed later).");
  spec_proposed_ = counter("tessera_spec_decode_num_draft_tokens_total", "Speculative tokens proposed.");
  spec_accepted_ = counter("tessera_spec_decode_num_accepted_tokens_total", "Speculative tokens accepted.");
  steps_ = counter("tessera_engine_steps_total", "Engine steps run.");
  running_ = gauge("tessera_num_requests_running", "Sequences running in the engine.");
  waiting_ = gauge("tessera_num_requests_waiting", "Requests waiting for the engine (queued or preempted).");
  kv_usage_ = gauge("tessera_kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1).");
  kv_blocks_total_ = gauge("tessera_kv_cache_blocks_total", "KV-cache blocks in the pool.");
  kv_host_hits_ = counter("tessera_kv_host_tier_hits_total",
                          "Prompt blocks copied back from the host KV tier instead of recomputed.");
  kv_disk_hits_ = counter("tessera_kv_disk_tier_hits_total",
                          "Prompt blocks copied back from the disk KV tier instead of recomputed.");
  kv_offloaded_ = counter("tessera_kv_offloaded_blocks_total", "Evicted KV blocks copied to the host tier.");
  kv_swap_out_ = counter("tessera_kv_swapped_out_blocks_total", "KV blocks of preempted requests swapped to the host tier.");
  kv_swap_in_ = counter("tessera_kv_swapped_in_blocks_total", "Swapped KV blocks copied back on resumption.");
  swapped_preemptions_ = counter("tessera_num_swapped_preemptions_total", "Preemptions by swap (not recomputed).");
  kv_bytes_to_tiers_ = counter("tessera_kv_tier_bytes_out_total", "Bytes copied from the KV pool to the host / disk tiers.");
  kv_bytes_from_tiers_ = counter("tessera_kv_tier_bytes_in_total", "Bytes copied from the host / disk tiers into the KV pool.");
  kv_host_blocks_total_ = gauge("tessera_kv_host_tier_blocks_total", "Blocks the host KV tier holds at most.");
  kv_host_usage_ = gauge("tessera_kv_host_tier_usage_perc", "Fraction of the host KV tier in use (0 to 1).");
  kv_disk_files_ = gauge("tessera_kv_disk_tier_blocks", "Block files in the disk KV tier.");
  expert_tokens_ = &prometheus::BuildCounter()
                        .Name("tessera_moe_expert_tokens_total")
                        .Help("Mixture-of-experts models: tokens routed to each expert, every layer summed.")
                        .Register(*registry_);
}

ServerMetrics::~ServerMetrics() = default;

void ServerMetrics::observe_ttft(double s) { ttft_->Observe(s); }
void ServerMetrics::observe_inter_token(double s) { itl_->Observe(s); }
void ServerMetrics::observe_e2e(double s) { e2e_->Observe(s); }
void ServerMetrics::observe_queue_time(double s) { queue_->Observe(s); }
void ServerMetrics::observe_request_tokens(int64_t prompt_tokens, int64_t generation_tokens) {
  prompt_len_->Observe(static_cast<double>(prompt_tokens));
  gen_len_->Observe(static_cast<double>(generation_tokens));
}

void ServerMetrics::request_finished(const std::string& finish_reason) {
  finished_->Add({{"model_name", model_}, {"finished_reason", finish_reason}}).Increment();
}

void ServerMetrics::lora_request(const std::string& lora_name) {
  lora_->Add({{"model_name", model_}, {"lora_name", lora_name}}).Increment();
}

void ServerMetrics::http_response(int status) {
  http_->Add({{"code", std::to_string(status)}}).Increment();
}

void ServerMetrics::update_engine(const infer::EngineStats& s) {
  auto add = [](prometheus::Counter* c, int64_t now, int64_t& last) {
    if (now > last) c->Increment(static_cast<double>(now - last));
    last = now;
  };
  add(prompt_tokens_, s.prompt_tokens, last_.prompt_tokens);
  add(gen_tokens_, s.generation_tokens, last_.generation_tokens);
  add(prefix_queries_, s.prefix_hit_blocks + s.prefix_miss_blocks, last_.prefix_queries);
  add(prefix_hits_, s.prefix_hit_blocks, last_.prefix_hit_blocks);
  add(kv_host_hits_, s.kv_host_hit_blocks, last_.kv_host_hit_blocks);
  add(kv_disk_hits_, s.kv_disk_hit_blocks, last_.kv_disk_hit_blocks);
  add(kv_offloaded_, s.kv_offloaded_blocks, last_.kv_offloaded_blocks);
  add(kv_swap_out_, s.kv_swap_out_blocks, last_.kv_swap_out_blocks);
  add(kv_swap_in_, s.kv_swap_in_blocks, last_.kv_swap_in_blocks);
  add(swapped_preemptions_, s.swapped_preemptions, last_.swapped_preemptions);
  add(kv_bytes_to_tiers_, s.kv_bytes_to_tiers, last_.kv_bytes_to_tiers);
  add(kv_bytes_from_tiers_, s.kv_bytes_from_tiers, last_.kv_bytes_from_tiers);
  kv_host_blocks_total_->Set(static_cast<double>(s.kv_host_blocks_total));
  kv_host_usage_->Set(s.kv_host_blocks_total > 0 ? static_cast<double>(s.kv_host_blocks_used) / s.kv_host_blocks_total : 0.0);
  kv_disk_files_->Set(static_cast<double>(s.kv_disk_files));
  add(preemptions_, s.preemptions, last_.preemptions);
  add(spec_proposed_, s.spec_proposed, last_.spec_proposed);
  add(spec_accepted_, s.spec_accepted, last_.spec_accepted);
  add(steps_, s.steps, last_.steps);
  running_->Set(static_cast<double>(s.running));
  waiting_->Set(static_cast<double>(s.waiting));
  kv_blocks_total_->Set(static_cast<double>(s.kv_blocks_total));
  kv_usage_->Set(s.kv_blocks_total > 0 ? static_cast<double>(s.kv_blocks_used) / s.kv_blocks_total : 0.0);
  if (!s.expert_tokens.empty()) {
    if (!expert_imbalance_)
      expert_imbalance_ = &prometheus::BuildGauge()
                               .Name("tessera_moe_load_imbalance")
                               .Help("Mixture-of-experts models: the busiest expert's tokens over the mean, so far.")
                               .Register(*registry_)
                               .Add({{"model_name", model_}});
    last_expert_tokens_.resize(s.expert_tokens.size(), 0);
    for (size_t e = 0; e < s.expert_tokens.size(); ++e)
      add(&expert_tokens_->Add({{"model_name", model_}, {"expert", std::to_string(e)}}), s.expert_tokens[e],
          last_expert_tokens_[e]);
    expert_imbalance_->Set(model::moe_load_imbalance(s.expert_tokens));
  }
}

std::string ServerMetrics::render() const {
  return prometheus::TextSerializer().Serialize(registry_->Collect());
}

}  // namespace tessera::serve
