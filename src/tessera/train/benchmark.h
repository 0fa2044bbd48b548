// The full training step as a benchmark (`tessera bench train`): the objects `tessera
// train` builds from the same run config (the DataParallel wrapper with its precision
// mode, the optimizer, clipping, publishing the weights), on random tokens, with MFU
// against the GEMM peak of the precision it runs (measured in the same run) and against
// the nominal peak, peak memory, and the stall an async checkpoint causes.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "tessera/model/model.h"
#include "tessera/train/config.h"

namespace tessera::train {

struct StepBenchOptions {
  int64_t batch = 4, seq = 64;  // one micro-batch (config.data.grad_accum of them per step)
  int repeats = 5;              // timed steps (median), after one warm-up
  bool optimizer = true;        // false: forward + backward only
  bool checkpoint = false;      // also measure an async checkpoint save during steps
  std::string checkpoint_dir;   // where (a temporary run directory; removed after)
  bool measure_peak = true;     // bf16 (or f32) matmul peak for MFU
  std::string trace;            // Chrome trace of the timed steps ("" = none): kernel spans
};

// One async checkpoint save measured on the steps that ran while it was in flight.
struct CheckpointStall {
  double blocking_seconds = 0;  // the step loop waited (start, and the update for the copy)
  double write_seconds = 0;     // background write (safetensors + fsync + checksums)
  double stall_fraction = 0;    // extra time of the overlapping steps over the median, / step
  std::vector<double> step_seconds;  // each step that ran while the save was in flight
};

struct StepBench {
  double step_seconds = 0;      // median full step
  double tokens_per_second = 0;
  double model_gflops = 0;      // model FLOPs (3 x forward) / step time
  std::string compute;          // model::describe_compute of the mode the step ran
  DType peak_dtype = DType::kF32;  // the GEMM precision the step multiplies in
  double peak_gflops = 0;       // kernels::measure_gemm_peak(peak_dtype), same run
  double mfu = 0;               // model_gflops / peak_gflops
  double nominal_gflops = 0;    // kernels::nominal_gemm_peak(peak_dtype)
  std::string nominal_how;
  double nominal_mfu = 0;
  double peak_rss_mb = 0;       // of the process after the steps
  // With checkpoint: the snapshot memory is reserved (faulted in) before the first save,
  // as the trainer does at start-up, then two saves run one after the other.
  int64_t ckpt_bytes = 0;
  double ckpt_reserve_seconds = 0;
  std::vector<CheckpointStall> ckpt;
};

// `model` must hold f32 master weights (as build_model makes them). The step is the
// trainer's: dp_config(config) (one process), dp_param_refs, Optimizer(config.optimizer),
// config.training's precision, bf16_mode, activation checkpointing and max_grad_norm.
StepBench bench_train_step(model::Model& model, const TrainConfig& config, const StepBenchOptions& o);

}  // namespace tessera::train
