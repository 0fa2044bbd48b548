// The planner's memory model applied to a `tessera train` run before it starts (issue 22):
// the bytes per rank the run will hold against the memory this machine has for each of its
// ranks, so an oversized batch is refused with the key to change instead of dying with
// "out of memory" or the OOM killer.
#pragma once
#include <cstdint>
#include <optional>
#include <string>

#include "tessera/model/config.h"
#include "tessera/plan/memory.h"
#include "tessera/train/config.h"

namespace tessera::plan {

struct RunMemory {
  StageMemory peak;        // the fullest rank's estimate
  double available = 0;    // bytes this machine has per rank on it
  int64_t local_ranks = 1;
  bool fits() const { return peak.total() <= available; }
};

// c: the run's config with its layout applied; m: its model (train::check_run);
// world: ranks of the job, local_ranks: those on this machine; available_bytes: this
// machine's free memory (MemAvailable).
RunMemory estimate_run_memory(const train::TrainConfig& c, const model::ModelConfig& m, int64_t world,
                              int64_t local_ranks, double available_bytes);
// One line when the run does not fit: the estimate by part, what is available, and the
// keys that lower the largest part. Nothing when it fits.
std::optional<std::string> run_memory_error(const train::TrainConfig& c, const RunMemory& r);

}  // namespace tessera::plan
