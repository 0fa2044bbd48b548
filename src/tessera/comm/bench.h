// Collective benchmark behind `tessera bench comm`: every algorithm of ours against the
// backend's own in the same run, with bandwidths as nccl-tests defines them.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "tessera/comm/communicator.h"

namespace tessera::comm {

struct CommBenchOptions {
  int64_t min_bytes = 4096;             // first message size (f32 elements: bytes / 4)
  int64_t max_bytes = int64_t{256} << 20;  // sizes go up by 4x to this
  std::vector<std::string> ops = {"all_reduce", "all_gather", "reduce_scatter"};
  // kShm is skipped where shm_available() is false (local backend, several nodes).
  std::vector<Algorithm> algorithms = {Algorithm::kRing, Algorithm::kHalvingDoubling,
                                       Algorithm::kHierarchical, Algorithm::kShm,
                                       Algorithm::kAuto, Algorithm::kBackend};
  int warmup = 2;             // untimed calls per point
  double min_seconds = 0.2;   // timed calls per point: enough to fill this (from the warm-up)
  int min_iterations = 5;
  int max_iterations = 5000;  // small messages: min_seconds of calls, not a few ms
};

// One (collective, size, algorithm) point. `bytes` is the whole tensor (all_reduce's
// buffer, all_gather's output, reduce_scatter's input), as nccl-tests counts it.
struct CommBenchRow {
  std::string backend;  // "local" | "mpi"
  int ranks = 0;
  std::string op;       // all_reduce | all_gather | reduce_scatter
  Algorithm algorithm = Algorithm::kAuto;
  int64_t bytes = 0;
  bool registered = false;  // its buffers came from alloc_shared's arena (never kBackend's)
  int iterations = 0;
  double seconds = 0;      // median over iterations of the slowest rank's time
  double algbw_gbps = 0;   // bytes / seconds / 1e9
  double busbw_gbps = 0;   // algbw x bus_factor(op, ranks)
  double ratio_vs_backend = 0;  // busbw / busbw of kBackend at the same point; 0 if not run
};

// nccl-tests' bus bandwidth factors: all_reduce 2(n-1)/n; all_gather, reduce_scatter (n-1)/n.
double bus_factor(const std::string& op, int ranks);

// Collective: every rank of `comm` calls it with the same options; every rank gets the
// same rows. Barrier before each timed call.
std::vector<CommBenchRow> bench_collectives(Communicator& comm, const CommBenchOptions& o);

std::string format_comm_bench_table(const std::vector<CommBenchRow>& rows);
std::string comm_bench_row_json(const CommBenchRow& row);  // one line, no newline

}  // namespace tessera::comm
