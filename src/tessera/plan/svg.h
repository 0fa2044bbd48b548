// `tessera plan train --svg FILE`: the chosen layout's pipeline schedule (forward and
// backward of every micro-batch on every stage, from a dependency-driven simulation of
// 1F1B, GPipe or the interleaved schedule) above a bar chart of memory per stage.
#pragma once
#include <string>
#include <vector>

#include "tessera/plan/infer.h"
#include "tessera/plan/search.h"

namespace tessera::plan {

struct PipelineOp {
  int device = 0, micro = 0, chunk = 0;  // chunk: virtual stage index on the device
  bool forward = true;
  double start = 0, end = 0;  // seconds from the step's start
};

// Simulates one step's pipeline: each device runs its ops in the schedule's order, an
// op starts when the device is free and its input (previous stage's forward, next
// stage's backward) is done. fwd/bwd are per stage and micro-batch (whole stage; a
// chunk takes 1/vpp of it).
std::vector<PipelineOp> simulate_pipeline(const Layout& l, int64_t micro_batches,
                                          const std::vector<double>& fwd,
                                          const std::vector<double>& bwd);

std::string render_plan_svg(const ModelSpec& m, const Hardware& hw, const TrainSetup& s,
                            const Evaluation& ev);
void write_plan_svg(const std::string& path, const ModelSpec& m, const Hardware& hw,
                    const TrainSetup& s, const Evaluation& ev);

// `tessera plan infer --svg FILE`: one bar per listed configuration, the device's memory
// split into weights, workspace, KV cache for its maximum concurrency, and what is left.
std::string render_infer_svg(const ModelSpec& m, const Hardware& hw, const InferSetup& s,
                             const std::vector<InferEvaluation>& configs);

}  // namespace tessera::plan
