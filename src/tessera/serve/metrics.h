// The server's Prometheus metrics (prometheus-cpp core; rendered by GET /metrics): request
// latency histograms, token / request / cache / speculation counters, and engine gauges.
// Names follow vLLM's with a tessera_ prefix. Thread-safe.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "tessera/infer/engine.h"

namespace prometheus {
class Registry;
class Counter;
class Gauge;
class Histogram;
template <typename T>
class Family;
}  // namespace prometheus

namespace tessera::serve {

class ServerMetrics {
 public:
  explicit ServerMetrics(const std::string& model_name);
  ~ServerMetrics();

  // Per-request latencies in seconds.
  void observe_ttft(double s);
  void observe_inter_token(double s);
  void observe_e2e(double s);
  void observe_queue_time(double s);
  void observe_request_tokens(int64_t prompt_tokens, int64_t generation_tokens);
  void request_finished(const std::string& finish_reason);  // stop | length | abort | timeout | error
  void http_response(int status);                           // every response, by status code
  void lora_request(const std::string& lora_name);          // a request admitted on a LoRA adapter
  // Counters follow the engine's cumulative stats (only the increase since the last call is
  // added); gauges take its current values.
  void update_engine(const infer::EngineStats& stats);

  std::string render() const;  // Prometheus text exposition format 0.0.4

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Histogram *ttft_, *itl_, *e2e_, *queue_, *prompt_len_, *gen_len_;
  prometheus::Family<prometheus::Counter>* finished_;
  prometheus::Family<prometheus::Counter>* http_;
  prometheus::Family<prometheus::Counter>* lora_;  // multi-LoRA: requests by adapter
  prometheus::Counter *prompt_tokens_, *gen_tokens_, *prefix_queries_, *prefix_hits_, *preemptions_;
  prometheus::Counter *spec_proposed_, *spec_accepted_, *steps_;
  prometheus::Gauge *running_, *waiting_, *kv_usage_, *kv_blocks_total_;
  // Tiered KV cache (infer/kv_tiers.h)
  prometheus::Counter *kv_host_hits_, *kv_disk_hits_, *kv_offloaded_, *kv_swap_out_, *kv_swap_in_, *swapped_preemptions_;
  prometheus::Counter *kv_bytes_to_tiers_, *kv_bytes_from_tiers_;
  prometheus::Gauge *kv_host_blocks_total_, *kv_host_usage_, *kv_disk_files_;
  prometheus::Family<prometheus::Counter>* expert_tokens_;  // MoE models, by expert
  prometheus::Gauge* expert_imbalance_ = nullptr;             // made at the first MoE stats
  std::vector<int64_t> last_expert_tokens_;
  infer::EngineStats last_;  // engine totals already added to the counters
  std::string model_;
};

}  // namespace tessera::serve
