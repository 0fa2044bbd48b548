// The training loop, on one process or N data-parallel ranks: data -> micro-batches ->
// forward/backward (gradients reduced by parallel::DataParallel) -> unscale / clip ->
// optimizer on this rank's shard -> metrics -> sharded checkpoints, with the loss-spike
// guard and exact resume (also onto a different number of ranks).
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "tessera/model/config.h"
#include "tessera/train/config.h"

namespace tessera::comm {
class Communicator;
}

namespace tessera::train {

struct TrainResult {
  int64_t start_step = 0;  // first step this invocation ran (after a resume)
  int64_t steps_run = 0;
  double final_loss = 0;   // train loss of the last step
  double val_loss = -1;    // at the end; -1 when there is no val split
  int64_t skipped_steps = 0;  // overflow (fp16) or non-finite gradients
  int64_t spikes = 0;
  int64_t rollbacks = 0;
  std::vector<double> losses;  // train loss of every step this invocation ran
  int world_size = 1;
  int rank = 0;
  std::string model_dir;       // OUT/model: the final model in Hugging Face layout
  std::string svg_path;        // OUT/loss_curve.svg ("" when not plotted)
  std::string trace_path;      // this rank's Chrome trace ("" when not traced)
  double seconds = 0;
  bool already_finished = false;  // --resume of a run whose last step is done: nothing ran
};

struct TrainOptions {
  bool resume = false;      // continue from OUT/checkpoints/latest
  int64_t stop_after = -1;  // stop (as if killed, no final save) after this step; tests
  // The data-parallel group. nullptr: MPI's world under mpirun, else this process alone.
  // Every rank runs run_training with the same config; rank 0 writes metrics and models.
  comm::Communicator* comm = nullptr;
};

// Runs the configured training. Errors (bad config values, missing data, unreadable
// checkpoint) throw tessera::Error before anything in OUT is overwritten.
TrainResult run_training(const TrainConfig& config, const TrainOptions& options = {});
// The checks every rank of a run makes before any weight exists (the data directory, the
// model's configuration, the layout against `world` ranks, the model and the batch), made
// once: the elastic supervisor calls it before starting mpirun, so a configuration error
// ends the job with one line instead of being restarted.
// Returns the run's model configuration.
model::ModelConfig check_run(const TrainConfig& config, int64_t world);

}  // namespace tessera::train
