// Serving estimates: KV cache, concurrency, decode and prefill bounds (docs/planner.md).
#include "tessera/plan/infer.h"

#include <algorithm>
#include <cmath>

#include "tessera/base/error.h"
#include "tessera/plan/comm_model.h"

namespace tessera::plan {

void InferSetup::validate() const {
  TESSERA_CHECK(context >= 1, "--context must be at least 1 token, got ", context);
  TESSERA_CHECK(prompt >= 0 && prompt <= context, "--prompt ", prompt, " must be in [1, --context ",
                context, "]");
  TESSERA_CHECK(tp >= 0, "--tp must be at least 1, got ", tp);
  TESSERA_CHECK(memory_utilization > 0 && memory_utilization <= 1,
                "--memory-utilization must be in (0, 1], got ", memory_utilization);
  TESSERA_CHECK(max_batched_tokens >= 1, "--max-batched-tokens must be at least 1");
  if (!weights.empty()) weight_bytes_per_param(weights);
  if (!kv.empty()) kv_bytes_per_element(kv, 128);
}

double weight_bytes_per_param(const std::string& w) {
  if (w == "bf16" || w == "fp16") return 2;
  if (w == "int8" || w == "fp8") return 1;
  if (w == "int4") return 0.5 + 2.0 / 128;
  fail("--weights: '", w, "' is not one of bf16, int8, int4");
}

double kv_bytes_per_element(const std::string& kv, int64_t head_dim) {
  if (kv == "bf16" || kv == "fp16") return 2;
  if (kv == "fp8") return 1;
  if (kv == "int8") return 1 + 2.0 / static_cast<double>(head_dim);
  fail("--kv: '", kv, "' is not one of bf16, fp8, int8");
}

double kv_bytes_per_token(const ModelSpec& m, const std::string& kv) {
  const int64_t vec = m.mla ? m.kv_lora_rank + m.rope_head_dim : m.head_dim;
  return static_cast<double>(m.layers) * m.kv_elements_per_token_layer() *
         kv_bytes_per_element(kv, vec);
}

InferEvaluation evaluate_inference(const ModelSpec& m, const Hardware& hw, const InferSetup& s,
                                   int tp, const std::string& weights, const std::string& kv) {
  InferEvaluation ev;
  ev.tp = tp, ev.weights = weights, ev.kv = kv;
  const double t = tp, h = static_cast<double>(m.hidden), e = 2;
  // Weights: quantized matmuls of the layers split by TP; embeddings, lm_head and norms 16-bit.
  double layer_mats = 0, norms = 0;
  for (int64_t l = 0; l < m.layers; ++l) {
    layer_mats += static_cast<double>(m.layer_params(l) - m.norm_params());
    norms += static_cast<double>(m.norm_params());
  }
  const double outside = static_cast<double>(m.embedding_params() + m.lm_head_params());
  ev.weight_bytes = layer_mats * weight_bytes_per_param(weights) / t + outside * 2 / t +
                    (norms + m.final_norm_params()) * 2;
  // KV cache: GQA heads split by TP (replicated once tp exceeds them); MLA's latent is
  // the same on every TP rank.
  ev.kv_bytes_per_token = kv_bytes_per_token(m, kv);
  const double share = m.mla ? 1.0 : std::max(1.0, m.kv_heads / t) / m.kv_heads;
  ev.kv_bytes_per_token_device = ev.kv_bytes_per_token * share;
  ev.kv_bytes_per_request = ev.kv_bytes_per_token_device * static_cast<double>(s.context);
  // Workspace: activations of one prefill chunk (residual, norm, attention and MLP outputs,
  // Q/K/V, MLP intermediates) and f32 logits for up to 256 sequences (vLLM's max_num_seqs).
  const double ffn = m.is_moe() ? static_cast<double>(m.top_k) * m.moe_ffn +
                                      static_cast<double>(m.shared_experts) * m.shared_ffn
                                : static_cast<double>(m.ffn);
  const double per_token = 4 * h + (m.q_width() + m.k_width() + m.v_width()) / t +
                           (m.gated_mlp ? 3 : 2) * ffn / t;
  ev.workspace_bytes = e * static_cast<double>(s.max_batched_tokens) * per_token +
                       4.0 * 256 * m.vocab / t;
  ev.kv_budget_bytes =
      hw.memory_bytes * s.memory_utilization - ev.weight_bytes - ev.workspace_bytes;
  ev.max_concurrency = ev.kv_budget_bytes <= 0
                           ? 0
                           : static_cast<int64_t>(std::floor(ev.kv_budget_bytes / ev.kv_bytes_per_request));

  const double bw = hw.effective_memory_bandwidth();
  const double peak = hw.peak("bf16") * hw.compute_efficiency;  // weight-only quantization
  const Link link = group_link(hw, tp, 1);
  const double heads = static_cast<double>(m.heads) / t;
  // MLA decodes in the absorbed form: attention runs over the latent (DeepSeek-V2 2.1).
  const double dqk = m.mla ? m.kv_lora_rank + m.rope_head_dim : m.qk_dim();
  const double dv = m.mla ? m.kv_lora_rank : m.v_dim();
  const double L = static_cast<double>(s.context);
  auto decode_step = [&](double c, bool* memory_bound) {
    const double bytes = ev.weight_bytes + c * L * ev.kv_bytes_per_token_device;
    const double flops = c * (2.0 * m.active_matmul_params() / t +
                              2.0 * m.layers * L * heads * (dqk + dv));
    const double mem = bytes / bw, comp = flops / peak;
    if (memory_bound) *memory_bound = mem >= comp;
    const double comm =
        2.0 * m.layers * collective_cost(Collective::kAllReduce, c * h * e, tp, link).seconds;
    return std::max(mem, comp) + comm;
  };
  ev.decode_step_single_s = decode_step(1, &ev.decode_memory_bound);
  ev.decode_tokens_per_s_single = 1 / ev.decode_step_single_s;
  if (ev.max_concurrency >= 1) {
    const double c = static_cast<double>(ev.max_concurrency);
    ev.decode_step_full_s = decode_step(c, nullptr);
    ev.decode_tokens_per_s_full = c / ev.decode_step_full_s;
    ev.decode_tokens_per_s_per_device = ev.decode_tokens_per_s_full / t;
  }
  // TTFT: the prompt's prefill, causal attention over P^2 / 2 pairs.
  const double P = static_cast<double>(s.prompt > 0 ? s.prompt : s.context);
  const double flops = 2.0 * P * m.active_matmul_params() / t +
                       P * P * m.layers * heads * (m.qk_dim() + m.v_dim());
  const double comp = flops / peak, mem = ev.weight_bytes / bw;
  ev.prefill_compute_bound = comp >= mem;
  ev.ttft_s = std::max(comp, mem) +
              2.0 * m.layers * collective_cost(Collective::kAllReduce, P * h * e, tp, link).seconds;
  return ev;
}

InferSearchResult search_inference(const ModelSpec& m, const Hardware& hw, const InferSetup& s) {
  InferSearchResult r;
  std::vector<int> tps;
  if (s.tp > 0) {
    TESSERA_CHECK(m.heads % s.tp == 0, "--tp ", s.tp, " does not divide the ", m.heads,
                  " attention heads of ", m.name);
    tps = {s.tp};
  } else {
    for (int tp = 1; tp <= hw.devices_per_node; tp *= 2)
      if (m.heads % tp == 0) tps.push_back(tp);
  }
  const std::vector<std::string> ws =
      s.weights.empty() ? std::vector<std::string>{"bf16", "int8", "int4"}
                        : std::vector<std::string>{s.weights};
  const std::vector<std::string> kvs =
      s.kv.empty() ? std::vector<std::string>{"bf16", "fp8", "int8"} : std::vector<std::string>{s.kv};
  for (int tp : tps)
    for (const auto& w : ws)
      for (const auto& kv : kvs) {
        InferEvaluation ev = evaluate_inference(m, hw, s, tp, w, kv);
        (ev.fits() ? r.ranked : r.rejected).push_back(ev);
      }
  std::stable_sort(r.ranked.begin(), r.ranked.end(), [](const auto& a, const auto& b) {
    return a.decode_tokens_per_s_per_device > b.decode_tokens_per_s_per_device;
  });
  std::stable_sort(r.rejected.begin(), r.rejected.end(), [](const auto& a, const auto& b) {
    return a.kv_budget_bytes - a.kv_bytes_per_request > b.kv_budget_bytes - b.kv_bytes_per_request;
  });
  return r;
}

}  // namespace tessera::plan
