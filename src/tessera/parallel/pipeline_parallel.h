// Pipeline parallelism for training: runs one step's micro-batches through this rank's
// stage of the model (Model::forward_chunk / backward_chunk) in the order a schedule gives
// (pipeline_schedule.h), sending activations forward and their gradients back to the
// neighbouring stages point to point over the pipeline group. Applied from outside: the
// model is a single-device Model holding one stage (Model::stage); data parallelism
// (DataParallel) and tensor parallelism compose with it. See docs/parallelism.md.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "tessera/comm/communicator.h"
#include "tessera/model/model.h"
#include "tessera/parallel/pipeline_schedule.h"

namespace tessera::parallel {

// Every stage needs ids (shapes) and positions (packed rows), the last stage targets.
using MicroBatch = model::TokenBatch;

// What one step did on this rank.
struct PipelineStep {
  double loss_sum = 0;  // sum over micro-batches of their mean loss (last stage; 0 elsewhere)
  int64_t count = 0;    // targets counted (last stage)
  int64_t activation_bytes = 0;  // most bytes saved for backward at once (passes in flight)
  int max_in_flight = 0;         // most forwards awaiting their backward at once
  std::vector<PipeSpan> spans;   // this rank's passes in schedule order, seconds from the start
  int64_t sent_bytes = 0, sent_messages = 0;  // activations and gradients to neighbours
  double recv_wait_s = 0;        // blocked waiting for a neighbour
  double seconds = 0;            // the step's pipeline part, start to last pass
  // Mixture-of-experts models: the slots this rank's layers routed over the micro-batches,
  // per expert, and per MoE layer of the whole model (its position among the model's MoE
  // layers; zeros for the other stages' layers), and the slots dropped over capacity.
  std::vector<double> expert_load;
  std::vector<std::vector<double>> layer_load;
  int64_t dropped = 0;
};

class Pipeline {
 public:
  // `model` holds stage pp.rank() of pp.size() (model.pp_stage()); every rank of `pp`
  // constructs one with the same schedule and micro-batch count (checked here).
  Pipeline(const model::Model& model, comm::Communicator& pp, PipeSchedule schedule,
           int micro_batches);

  const PipeShape& shape() const { return shape_; }
  PipeSchedule schedule() const { return schedule_; }
  const std::vector<std::vector<PipeAction>>& actions() const { return actions_; }

  // Runs the step: batches.size() == micro_batches. Gradients go into `grads` as
  // forward_backward's do (each chunk's first backward assigns, the rest accumulate),
  // each scaled by grad_scale (1 / micro-batches for a mean). before_backward(chunk, last)
  // is called before each backward, last = it is that chunk's final micro-batch (a data-
  // parallel wrapper reduces gradients only then).
  PipelineStep run(const std::vector<MicroBatch>& batches, model::Params& grads, float grad_scale,
                   const std::function<void(int chunk, bool last)>& before_backward = {});

  // Evaluation: forward only, batch after batch through every virtual stage. Returns the
  // sum of token losses and the targets counted (at the last stage; 0 and 0 elsewhere).
  std::pair<double, int64_t> evaluate(const std::vector<MicroBatch>& batches);

  comm::Communicator& comm() const { return pp_; }  // the pp group

 private:
  // A backward pass's expert loads into the step's (PipelineStep::expert_load, layer_load).
  void add_expert_loads(int chunk, const model::Model::LossResult& lr, PipelineStep& out) const;

  const model::Model& model_;
  comm::Communicator& pp_;
  PipeSchedule schedule_;
  PipeShape shape_;
  std::vector<std::vector<PipeAction>> actions_;
};

// The whole model's Hugging Face tensors on pipeline rank 0, from `mine` (each stage's own
// whole tensors) of every stage: collective over `pp` when `participate` (the ranks holding
// whole tensors: tp rank 0 of data-parallel replica 0); elsewhere returns {} at once. Other
// ranks get {}. virtual_stages and layers are the layout's (model::pipeline_stage).
std::vector<std::pair<std::string, Tensor>> gather_stage_tensors(
    const model::ModelConfig& config, comm::Communicator& pp, bool participate,
    std::vector<std::pair<std::string, Tensor>> mine, int virtual_stages,
    const std::vector<int64_t>& layers);

}  // namespace tessera::parallel
