// What `tessera plan infer` prints: the serving table, --explain arithmetic and --json.
#include <cmath>
#include <cstdio>
#include <sstream>

#include "tessera/base/strings.h"
#include "tessera/plan/report.h"

namespace tessera::plan {

std::string describe_infer_setup(const ModelSpec& m, const Hardware& hw, const InferSetup& s) {
  std::ostringstream os;
  os << "model: " << m.describe() << "\n";
  os << "hardware: " << hw.name << " (" << format_bytes(hw.memory_bytes) << ", "
     << hw.memory_bandwidth / 1e9 << " GB/s, " << hw.peak("bf16") / 1e12 << " TFLOP/s bf16)\n";
  os << "requests: " << s.context << " tokens of context, TTFT for a "
     << (s.prompt > 0 ? s.prompt : s.context) << "-token prompt; " << s.memory_utilization * 100
     << "% of memory usable\n";
  return os.str();
}

std::string format_infer_table(const std::vector<InferEvaluation>& evs) {
  std::ostringstream os;
  os << base::strprintf("%3s  %-3s %-7s %-5s | %10s %11s %11s | %10s | %10s %12s %12s | %9s\n", "#",
                        "tp", "weights", "kv", "weights", "KV/token", "KV/request", "max reqs",
                        "tok/s (1)", "tok/s (max)", "tok/s/device", "TTFT");
  int rank = 0;
  for (const auto& ev : evs) {
    os << base::strprintf(
        "%3d  %-3d %-7s %-5s | %10s %11s %11s | %10lld | %10.1f %12.1f %12.1f | %9s\n", ++rank,
        ev.tp, ev.weights.c_str(), ev.kv.c_str(), format_bytes(ev.weight_bytes).c_str(),
        format_bytes(ev.kv_bytes_per_token_device).c_str(),
        format_bytes(ev.kv_bytes_per_request).c_str(), static_cast<long long>(ev.max_concurrency),
        ev.decode_tokens_per_s_single, ev.decode_tokens_per_s_full,
        ev.decode_tokens_per_s_per_device, format_seconds(ev.ttft_s).c_str());
  }
  return os.str();
}

std::string explain_infer(const ModelSpec& m, const Hardware& hw, const InferSetup& s,
                          const InferEvaluation& ev) {
  std::ostringstream os;
  os << base::strprintf("== tp=%d, weights %s, KV cache %s ==\n", ev.tp, ev.weights.c_str(),
                        ev.kv.c_str());
  os << base::strprintf(
      "weights per device = layer matrices x %.4g bytes / tp + embeddings, lm_head, norms x 2 "
      "bytes = %s\n",
      weight_bytes_per_param(ev.weights), format_bytes(ev.weight_bytes).c_str());
  if (m.mla)
    os << base::strprintf(
        "KV bytes per token = layers x (kv_lora_rank + rope_dim) x bytes = %lld x %lld x %.4g = "
        "%.0f\n",
        static_cast<long long>(m.layers), static_cast<long long>(m.kv_lora_rank + m.rope_head_dim),
        kv_bytes_per_element(ev.kv, m.kv_lora_rank + m.rope_head_dim), ev.kv_bytes_per_token);
  else
    os << base::strprintf(
        "KV bytes per token = 2 x layers x kv_heads x head_dim x bytes = 2 x %lld x %lld x %lld x "
        "%.4g = %.0f\n",
        static_cast<long long>(m.layers), static_cast<long long>(m.kv_heads),
        static_cast<long long>(m.head_dim), kv_bytes_per_element(ev.kv, m.head_dim),
        ev.kv_bytes_per_token);
  os << base::strprintf("per device under tp=%d: %.0f bytes/token; a %lld-token request: %s\n",
                        ev.tp, ev.kv_bytes_per_token_device, static_cast<long long>(s.context),
                        format_bytes(ev.kv_bytes_per_request).c_str());
  os << base::strprintf("workspace (one %lld-token prefill chunk, logits for 256 sequences) = %s\n",
                        static_cast<long long>(s.max_batched_tokens),
                        format_bytes(ev.workspace_bytes).c_str());
  os << base::strprintf("KV budget = %s x %.2f - weights - workspace = %s\n",
                        format_bytes(hw.memory_bytes).c_str(), s.memory_utilization,
                        format_bytes(ev.kv_budget_bytes).c_str());
  os << base::strprintf("max concurrent requests = floor(budget / per-request KV) = %lld\n",
                        static_cast<long long>(ev.max_concurrency));
  os << base::strprintf(
      "decode, 1 request: (weights + context x KV/token) / (%.0f GB/s x %.2f) %s = %s per token -> "
      "%.1f tokens/s\n",
      hw.memory_bandwidth / 1e9, hw.memory_efficiency,
      ev.decode_memory_bound ? "(memory-bound)" : "(compute-bound)",
      format_seconds(ev.decode_step_single_s).c_str(), ev.decode_tokens_per_s_single);
  if (ev.max_concurrency >= 1)
    os << base::strprintf(
        "decode, %lld requests at full context: step %s -> %.1f tokens/s in all, %.1f per device\n",
        static_cast<long long>(ev.max_concurrency), format_seconds(ev.decode_step_full_s).c_str(),
        ev.decode_tokens_per_s_full, ev.decode_tokens_per_s_per_device);
  os << base::strprintf(
      "TTFT = (2 N_active P + P^2 L heads (d_qk + d_v)) / tp / (%.0f TFLOP/s x %.2f) + TP "
      "all-reduces = %s (%s)\n",
      hw.peak("bf16") / 1e12, hw.compute_efficiency, format_seconds(ev.ttft_s).c_str(),
      ev.prefill_compute_bound ? "compute-bound" : "memory-bound");
  return os.str();
}

nlohmann::json infer_evaluation_json(const InferEvaluation& ev) {
  nlohmann::json j;
  j["tp"] = ev.tp;
  j["weights"] = ev.weights;
  j["kv"] = ev.kv;
  j["fits"] = ev.fits();
  j["weight_bytes_per_device"] = ev.weight_bytes;
  j["kv_bytes_per_token"] = ev.kv_bytes_per_token;
  j["kv_bytes_per_token_per_device"] = ev.kv_bytes_per_token_device;
  j["kv_bytes_per_request"] = ev.kv_bytes_per_request;
  j["workspace_bytes"] = ev.workspace_bytes;
  j["kv_budget_bytes"] = ev.kv_budget_bytes;
  j["max_concurrent_requests"] = ev.max_concurrency;
  j["decode_tokens_per_s_single"] = ev.decode_tokens_per_s_single;
  j["decode_tokens_per_s_at_max"] = ev.decode_tokens_per_s_full;
  j["decode_tokens_per_s_per_device"] = ev.decode_tokens_per_s_per_device;
  j["ttft_s"] = ev.ttft_s;
  j["decode_memory_bound"] = ev.decode_memory_bound;
  j["prefill_compute_bound"] = ev.prefill_compute_bound;
  return j;
}

}  // namespace tessera::plan
