// A planner layout applied to a training run's configuration: `tessera train --layout`
// takes the same spelling as `tessera plan train --layout` (plan::parse_layout).
#pragma once
#include <string>

#include "tessera/plan/layout.h"
#include "tessera/train/config.h"

namespace tessera::plan {

// Sets the [parallel] axes (dp, tp, pp, cp, ep), zero_stage, sequence_parallel, offload,
// the pipeline schedule and virtual stages, and activation_checkpointing from `l`; the
// global batch (batch_size x grad_accum) is kept, regrouped as micro-batches of dp x mb
// sequences: batch_size = dp x mb, grad_accum = global / batch_size. Throws one line
// naming --layout and the reason when the global batch does not regroup.
void apply_layout(const Layout& l, train::TrainConfig& c);

// The device count a --layout spelling is read against: the world size when known (> 0),
// else the product of the axes it gives (one process: dp = 1 unless given).
int64_t layout_devices(const std::string& spec, int64_t world);

}  // namespace tessera::plan
