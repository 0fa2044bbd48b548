// Memory per device of a training layout: model states under DP / ZeRO-1/2/3 / offload
// with TP, PP and EP sharding (Rajbhandari et al. 2020), activations per layer with
// none / selective / full recomputation and sequence parallelism (Korthikanti et al.
// 2022), in-flight micro-batches of 1F1B, GPipe and interleaved pipelines, temporary
// buffers and a fragmentation allowance. Formulas: docs/planner.md.
#pragma once
#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "tessera/plan/layout.h"

namespace tessera::plan {

// Bytes one layer stores for backward, for one micro-batch on one device (before
// recomputation is applied). Korthikanti et al. 2022, section 4.1, generalised to GQA,
// SwiGLU, MLA, MoE and flash attention; with GPT-3's shape, dropout and no flash
// attention the sum without norm_stats is exactly s b h (34 + 5 a s / h).
struct ActivationTerms {
  double layer_io = 0;        // norm inputs, QKV input, MLP input (not split by TP; by SP)
  double dropout_masks = 0;   // after attention and after the MLP, 1 byte each (split by SP)
  double norm_stats = 0;      // per-token f32 statistics of the two norms (split by SP)
  double qkv = 0;             // Q, K, V (MLA: also the latents), split by TP
  double attention_core = 0;  // softmax + dropout of the scores, or flash's log-sum-exp
  double attention_out = 0;   // input of the output projection
  double mlp = 0;             // MLP intermediates (gate, up, activation), routed experts
  double moe_routing = 0;     // router logits and the dispatched token copies
  double total() const {
    return layer_io + dropout_masks + norm_stats + qkv + attention_core + attention_out + mlp +
           moe_routing;
  }
};

// `e` is bytes per stored activation element; tokens are micro_batch x seq / cp. `em`
// (< 0: e) is that of the activations that feed only matmuls (the norm outputs and the
// MLP's product), which Tessera's CPU build keeps as bf16 under native bf16 (StateBytes).
ActivationTerms layer_activation_terms(const ModelSpec& m, int64_t layer, const TrainSetup& s,
                                       const Layout& l, double e, double em = -1);
// What layer `layer` keeps per micro-batch once recomputation is applied: everything
// (none); all but attention_core, and attention_out unless the setup keeps it
// (selective); only the layer input (full).
double layer_activation_bytes(const ModelSpec& m, int64_t layer, const TrainSetup& s,
                              const Layout& l, double e, double em = -1);

struct StageMemory {
  int stage = 0;
  int64_t first_layer = 0, layers = 0;
  double params = 0;     // parameters whose weights live on this device (before ZeRO-3)
  double in_flight = 0;  // micro-batches whose activations are held at the peak
  double weights = 0, grads = 0, master = 0, moments = 0;  // bytes
  double activations = 0;  // saved for backward, all in-flight micro-batches
  double temporary = 0;    // logits, backward working set, gathered ZeRO-3 layers, buckets
  double reserved = 0;     // runtime context and library workspaces
  double fragmentation = 0;
  double host = 0;         // offloaded to host memory (not counted in total)
  double optimizer() const { return master + moments; }
  double total() const {
    return weights + grads + master + moments + activations + temporary + reserved + fragmentation;
  }
};

struct MemoryEstimate {
  std::vector<StageMemory> stages;  // one per pipeline stage
  int worst = 0;                    // the stage with the largest total
  double capacity = 0;              // device memory
  double host_capacity = 0;         // host memory per device (offload)
  const StageMemory& peak() const { return stages[worst]; }
  double host_peak() const;
  // Device memory holds the peak stage, and host memory what offload puts there.
  bool fits() const { return over_bytes() <= 0; }
  double over_bytes() const {
    const double host_over = host_peak() > 0 ? host_peak() - host_capacity : -1e300;
    return std::max(peak().total() - capacity, host_over);
  }
};

// Layers [begin, end) of pipeline stage `stage`: L / pp each, the remainder on the last stages.
std::pair<int64_t, int64_t> stage_layers(int64_t layers, int pp, int stage);
// Micro-batches (in units of the stage's whole layer set) whose activations stage
// `stage` holds at its peak: GPipe m; 1F1B min(pp - stage, m); interleaved
// min(v m, 2 (pp - stage - 1) + (v - 1) pp + 1) / v (Narayanan et al. 2021).
double in_flight_micro_batches(const Layout& l, int64_t m, int stage);

MemoryEstimate estimate_memory(const ModelSpec& m, const Hardware& hw, const TrainSetup& s,
                               const Layout& l);

// Model-state bytes per parameter on one of `n` data-parallel devices (no TP/PP): the
// ZeRO paper's (2 + 2 + K) Psi with K = 12 for mixed-precision Adam, divided by stage.
double zero_bytes_per_param(int stage, int n, const StateBytes& b);

}  // namespace tessera::plan
