// Serving estimates: KV-cache bytes per token and request, how many requests of a given
// length fit beside the weights, decode tokens/s bounded by memory bandwidth, prefill
// (TTFT) bounded by compute, under TP and weight / KV quantization; and a search over
// TP degree and quantization.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "tessera/plan/hardware.h"
#include "tessera/plan/model_spec.h"

namespace tessera::plan {

struct InferSetup {
  int64_t context = 0;  // tokens per request (prompt + output)
  int64_t prompt = 0;   // prompt tokens for TTFT (0: the whole context)
  int tp = 0;           // 0: search 1, 2, 4, ... up to devices per node
  std::string weights;  // bf16 | int8 | int4; empty: search
  std::string kv;       // bf16 | fp8 | int8; empty: search
  double memory_utilization = 0.9;  // vLLM's gpu_memory_utilization default
  int64_t max_batched_tokens = 8192;  // prefill chunk the activation workspace is sized for
  void validate() const;
};

// Bytes per weight element: bf16 2; int8 1 (per-channel scales); int4 0.5 + one fp16
// scale per group of 128 (GPTQ / AWQ layout). Embeddings and lm_head stay 16-bit.
double weight_bytes_per_param(const std::string& weights);
// Bytes per KV element: bf16 2; fp8 1; int8 1 + an fp16 scale per head vector.
double kv_bytes_per_element(const std::string& kv, int64_t head_dim);
// 2 x layers x kv_heads x head_dim x bytes (GQA), layers x (kv_lora + rope) x bytes (MLA).
double kv_bytes_per_token(const ModelSpec& m, const std::string& kv);

struct InferEvaluation {
  int tp = 1;
  std::string weights, kv;
  double weight_bytes = 0;          // per device
  double kv_bytes_per_token = 0;    // whole model
  double kv_bytes_per_token_device = 0;  // per device under TP
  double kv_bytes_per_request = 0;  // per device, a full-context request
  double workspace_bytes = 0;       // activations of one prefill chunk + logits
  double kv_budget_bytes = 0;       // memory x utilization - weights - workspace
  int64_t max_concurrency = 0;      // full-context requests that fit
  double decode_step_single_s = 0;  // one request
  double decode_tokens_per_s_single = 0;
  double decode_step_full_s = 0;    // max_concurrency requests at full context
  double decode_tokens_per_s_full = 0;  // aggregate over the requests
  double decode_tokens_per_s_per_device = 0;
  double ttft_s = 0;                // prefill of the prompt on an idle server
  bool prefill_compute_bound = true;
  bool decode_memory_bound = true;
  bool fits() const { return max_concurrency >= 1; }
};

InferEvaluation evaluate_inference(const ModelSpec& m, const Hardware& hw, const InferSetup& s,
                                   int tp, const std::string& weights, const std::string& kv);

struct InferSearchResult {
  std::vector<InferEvaluation> ranked;  // fitting, by decode tokens/s per device
  std::vector<InferEvaluation> rejected;  // did not fit even one request
};
InferSearchResult search_inference(const ModelSpec& m, const Hardware& hw, const InferSetup& s);

}  // namespace tessera::plan
