// Time per training step of a layout: compute from FLOPs at an achievable rate, memory-
// bound work from bytes at memory bandwidth, alpha-beta communication of TP / CP / EP /
// PP / DP with stated overlap, the pipeline bubble, the optimizer step; then MFU,
// tokens/s and time to train on D tokens with a failure-and-restart allowance.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "tessera/plan/layout.h"

namespace tessera::plan {

// Per micro-batch on one pipeline stage (seconds).
struct StageTime {
  double gemm_fwd = 0, gemm_bwd = 0;    // matmuls (backward: input and weight gradients)
  double attn_fwd = 0, attn_bwd = 0;    // attention core (QK^T, softmax, AV)
  double elementwise = 0;               // memory-bound work: norms, activations, residuals, loss
  double recompute = 0;                 // forward work redone in backward
  double tp_comm = 0, cp_comm = 0, ep_comm = 0;  // exposed, per micro-batch
  double compute() const { return gemm_fwd + gemm_bwd + attn_fwd + attn_bwd + elementwise + recompute; }
  double total() const { return compute() + tp_comm + cp_comm + ep_comm; }
};

struct StepTime {
  std::vector<StageTime> stages;
  int slowest = 0;
  int64_t micro_batches = 0;
  // Whole step (seconds); the parts add up to total.
  double compute = 0;       // micro_batches x the slowest stage's compute
  double tp_comm = 0, cp_comm = 0, ep_comm = 0;  // exposed, all micro-batches
  double pp_comm = 0;       // exposed point-to-point on the pipeline's critical path
  double dp_comm = 0;       // exposed data-parallel gradient / parameter traffic
  double dp_comm_total = 0; // before overlap
  double bubble = 0;        // pipeline fill and drain
  double optimizer = 0;     // optimizer step (and offload transfers)
  double total = 0;
  double comm_exposed() const { return tp_comm + cp_comm + ep_comm + pp_comm + dp_comm; }
  // Rates.
  double model_flops = 0;      // per step: (6 N + 6 L s a (d_qk + d_v)) x tokens (PaLM's count)
  double hardware_flops = 0;   // per step, all devices: what actually runs (causal, recompute)
  double tokens_per_s = 0;
  double mfu = 0;              // model_flops / (total x devices x peak)
  double hfu = 0;
};

// Model FLOPs per token, as PaLM (Chowdhery et al. 2022, appendix B) counts them:
// 6 x matmul parameters a token touches + 6 L s heads (d_qk + d_v) for attention.
double model_flops_per_token(const ModelSpec& m, int64_t seq);

// Bytes of memory-bound work the model counts for layer `layer` and one micro-batch: each
// stored activation written and read once forward, read and its gradient written and
// read once backward (5x the layer's activation bytes without recomputation); where
// 16-bit values live in f32 (Tessera's CPU build), each GEMM's activation operands are
// also rounded in a read-and-write pass (8 bytes per element). Timed at the hardware's
// elementwise bandwidth.
double layer_elementwise_bytes(const ModelSpec& m, int64_t layer, const TrainSetup& s,
                               const Layout& l, const Hardware& hw);
// Bytes per parameter of the optimizer step on this device's shard: read and write the
// fp32 master and the moments, read the gradient, write the weight (read-modify-write
// when there is no master copy), plus four passes over the gradients (the clipping norm,
// scaling in place, zeroing).
double optimizer_bytes_per_param(const StateBytes& b);

StepTime estimate_step_time(const ModelSpec& m, const Hardware& hw, const TrainSetup& s,
                            const Layout& l);

// Time to train on D tokens with failures: job MTBF M = device MTBF / devices; a
// checkpoint every tau seconds stalls delta seconds (tau = sqrt(2 delta M), Young 1974,
// when not given); each failure loses tau / 2 of work plus the restart R (Daly 2006,
// first order): wall = ideal (1 + delta / tau) / (1 - (tau / 2 + R) / M).
struct TrainingTime {
  double ideal_s = 0;        // D / tokens_per_s
  double job_mtbf_s = 0;
  double checkpoint_interval_s = 0;
  double wall_s = 0;         // with checkpoints, failures and restarts; inf if it never ends
  double expected_failures = 0;
  double overhead() const { return ideal_s > 0 ? wall_s / ideal_s - 1 : 0; }
};
TrainingTime estimate_training_time(const TrainSetup& s, double tokens_per_s);

}  // namespace tessera::plan
