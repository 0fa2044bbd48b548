// Optimizers for training: AdamW (decoupled weight decay, torch.optim.AdamW's f32 op
// order) and Muon (Newton-Schulz-orthogonalised momentum) for 2-D hidden weights.
// Model-agnostic: the trainer hands in a list of parameter / gradient views.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "tessera/kernels/optimizer_math.h"
#include "tessera/tensor/tensor.h"

namespace tessera::comm {
class Communicator;
}

namespace tessera::train {

// One trainable tensor. param and grad are f32, contiguous, on the CPU, same shape; the
// optimizer updates param in place and only reads grad. The trainer decides the flags:
// decay (and muon) only for 2-D hidden matmul weights, never for embeddings, norms, biases.
struct ParamRef {
  std::string name;   // unique; names the optimizer state tensors ("exp_avg.<name>")
  Tensor param;       // any shape
  Tensor grad;        // same shape as param
  bool decay = false; // apply weight decay
  bool muon = false;  // update with Muon when OptimizerConfig::name == "muon" (must be 2-D)
  // Its share of the global gradient norm's sum of squares: 1, or 1/tp for a tensor every
  // tensor-parallel rank holds whole (the sum over the tp group then counts it once).
  double norm_share = 1.0;
  // The update's chunks (its units of parallel work, ~64K elements) start where
  // (chunk_phase + element) is a multiple of chunk_align: 16 rows of a weight kept packed
  // (kernels/packed_b.h) whose element 0 is element chunk_phase of the weight.
  int64_t chunk_align = 1, chunk_phase = 0;
  // Under tensor parallelism, a Muon matrix split over the tp group: param is this rank's
  // block of the whole (full_shape) matrix at block_offset; Muon orthogonalises the whole
  // update (gathered from the group's blocks) and keeps this block of it, as one process
  // would. nullptr: param is the whole matrix.
  comm::Communicator* tp_group = nullptr;
  std::vector<int64_t> block_offset{};
  Shape full_shape{};
};

// Field names are the TOML keys of the trainer's [optimizer] table.
struct OptimizerConfig {
  std::string name = "adamw";  // "adamw" | "muon" (Muon for ParamRef.muon tensors, AdamW for the rest)
  double lr = 3e-4;            // peak lr of the AdamW part; the schedule multiplies it
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.1;
  double muon_lr = 0.02, muon_momentum = 0.95;
  bool muon_nesterov = true;
  int muon_ns_steps = 5;
  double muon_weight_decay = 0.0;
};

// Throws tessera::Error naming the field when a value is out of range.
void validate_optimizer_config(const OptimizerConfig& c);

using kernels::ParamCopies;

struct StepOptions {
  // Every gradient is multiplied by this (rounded to f32, as torch's in-place
  // clip_grad_norm_ leaves it) as the update reads it: clipping without a pass of its own.
  // The gradients themselves are left as they are.
  double grad_scale = 1.0;
  // Parallel to params(): where each parameter's new value is also written, in the same
  // pass as its update (a mixed-precision wrapper's weights; DataParallel::piece_copies).
  const std::vector<ParamCopies>* copies = nullptr;
};

class Optimizer {
 public:
  // Allocates zeroed state for every parameter (exp_avg / exp_avg_sq, or momentum).
  Optimizer(OptimizerConfig config, std::vector<ParamRef> params);

  // One step with learning-rate multiplier lr_scale (the schedule value, usually in
  // [0, 1]): AdamW params use config.lr * lr_scale, Muon params config.muon_lr * lr_scale.
  void step(double lr_scale, const StepOptions& options = {});
  int64_t step_count() const { return step_; }
  const OptimizerConfig& config() const { return config_; }
  const std::vector<ParamRef>& params() const { return params_; }

  // State for checkpoints: views of the live state tensors, named "exp_avg.<param>",
  // "exp_avg_sq.<param>" (AdamW params) and "momentum.<param>" (Muon params), in
  // parameter order. The step count is saved separately by the caller.
  std::vector<std::pair<std::string, Tensor>> state_tensors() const;
  // Copies saved state in; the names must be exactly those state_tensors() returns and
  // shapes must match (errors name the tensor). Any float dtype is accepted (converted).
  void load_state(const std::vector<std::pair<std::string, Tensor>>& tensors, int64_t step_count);

 private:
  struct State {  // of params_[i]
    bool use_muon = false;
    Tensor exp_avg, exp_avg_sq;  // AdamW: same shape as the param
    Tensor momentum;             // Muon: same shape as the param
  };
  struct Chunk {  // a contiguous piece of one AdamW parameter; the unit of parallel work
    int64_t param;
    int64_t begin, end;
  };
  void step_adamw(double lr, const StepOptions& o);
  void step_muon(double lr, const StepOptions& o);
  // The orthogonalised update of a Muon matrix split over tensor-parallel ranks (this
  // rank's block u of the whole update): collective over ref.tp_group.
  Tensor orthogonalise_block(const ParamRef& ref, const Tensor& u) const;

  OptimizerConfig config_;
  std::vector<ParamRef> params_;
  std::vector<State> state_;          // parallel to params_
  std::vector<Chunk> adamw_chunks_;   // covers every AdamW element exactly once
  int64_t step_ = 0;
};

// --- building blocks, public for tests and benchmarks ---

using kernels::AdamWScalars;
AdamWScalars adamw_scalars(double lr, double beta1, double beta2, double eps, double weight_decay,
                           int64_t t);
// The fused AdamW pass and its ISA choice live in kernels/optimizer_math.h.
using kernels::adamw_update;
using kernels::AdamWKernel;
using kernels::set_adamw_kernel_for_testing;

// Muon's orthogonalisation: `steps` quintic Newton-Schulz iterations on g / (||g||_F + 1e-7),
// coefficients (3.4445, -4.7750, 2.0315), on the transpose when rows > cols. f32 throughout
// (the public implementation runs in bf16 on GPUs). g: (rows, cols) f32; returns (rows, cols).
Tensor newton_schulz5(const Tensor& g, int steps);

}  // namespace tessera::train
