// The full training step as a benchmark (`tessera bench train`): forward, backward,
// clipping, AdamW and the compute-weight refresh, with MFU against the matmul peak
// measured in the same run, peak memory, and the stall an async checkpoint causes.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "tessera/model/model.h"

namespace tessera::train {

struct StepBenchOptions {
  int64_t batch = 4, seq = 64;
  int repeats = 5;              // timed steps (median), after one warm-up
  bool optimizer = true;        // false: forward + backward only
  double max_grad_norm = 1.0;
  bool checkpoint = false;      // also measure an async checkpoint save during steps
  std::string checkpoint_dir;   // where (a temporary run directory; removed after)
  bool measure_peak = true;     // bf16 (or f32) matmul peak for MFU
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
  double peak_gflops = 0;       // matmul peak measured in the same run (compute dtype)
  double mfu = 0;
  double peak_rss_mb = 0;       // of the process after the steps
  // With checkpoint: the snapshot memory is reserved (faulted in) before the first save,
  // as the trainer does at start-up, then two saves run one after the other.
  int64_t ckpt_bytes = 0;
  double ckpt_reserve_seconds = 0;
  std::vector<CheckpointStall> ckpt;
};

// `model` must hold f32 master weights; its compute dtype and recompute mode are used.
StepBench bench_train_step(model::Model& model, const StepBenchOptions& o);

}  // namespace tessera::train
