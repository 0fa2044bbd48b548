// Evaluating one training layout, and the search over every valid (dp, tp, pp, cp, ep,
// ZeRO stage, micro-batch, recomputation, SP): discard what does not fit (by how much),
// rank the rest by predicted tokens/s.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "tessera/plan/memory.h"
#include "tessera/plan/time_model.h"

namespace tessera::plan {

struct Evaluation {
  Layout layout;
  MemoryEstimate memory;
  StepTime time;
  TrainingTime training;
  bool fits() const { return memory.fits(); }
};

Evaluation evaluate_layout(const ModelSpec& m, const Hardware& hw, const TrainSetup& s,
                           const Layout& l);

struct SearchOptions {
  int keep = 10;           // ranked layouts kept
  int max_tp = 0;          // 0: devices per node (TP stays inside a node)
  int max_micro_batch = 64;
};

struct SearchResult {
  std::vector<Evaluation> ranked;         // fitting layouts, fastest first (at most keep)
  std::vector<Evaluation> nearest_misses; // non-fitting layouts that miss by the least
  int64_t valid = 0;        // layouts that divide the model and the cluster
  int64_t fitting = 0;
  int64_t too_big = 0;      // valid but over device memory
  bool offload = false;     // nothing fit without offload; these layouts offload
  bool offload_tried = false;  // offload was searched too
};

// All layouts of s.devices devices; 1F1B for pipelines. ZeRO-Offload layouts are searched
// only when nothing fits without offload (SearchResult::offload says so).
SearchResult search_layouts(const ModelSpec& m, const Hardware& hw, const TrainSetup& s,
                            const SearchOptions& o = {});

std::vector<int64_t> divisors(int64_t n);

}  // namespace tessera::plan
